"""Builds the draft-model proposer named by EngineConfig.speculative (None for n-gram or no speculation)."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.engine.runner import KVCache, ModelRunner
from kvserve.model.llama import LlamaModel
from kvserve.model.registry import load_model
from kvserve.spec.draft import DraftModelProposer


def build_draft_proposer(
    config: dict[str, Any] | None, target: ModelRunner, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> DraftModelProposer | None:
    if not config or config.get("method") != "draft":
        return None
    if "draft_model" in config:
        loaded = load_model(str(config["draft_model"]))
        tgt = target.model.config
        if loaded.config.vocab_size != tgt.vocab_size:
            raise ValueError("speculative.draft_model must share the target's tokenizer (vocab sizes differ)")
        max_len = target.model.rope_cos.shape[0]
        model = LlamaModel(loaded.config, loaded.load_weights(dtype), dtype, device, max_len)
        # The draft's own paged KV, addressed by the same block ids as the target's.
        cache = KVCache(model, num_blocks, target.cache.block_size)
        return DraftModelProposer(ModelRunner(model, cache, target.attention), None, mirrors_target=True)
    layers = int(config.get("draft_layers", 12))
    total = target.model.config.num_layers
    if not 1 <= layers < total:
        raise ValueError(f"speculative.draft_layers must be in [1, {total - 1}], got {layers}")
    return DraftModelProposer(target, layers, mirrors_target=False)
