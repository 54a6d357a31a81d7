"""HF transformers on the same GGUF file: the reference our outputs are compared with (tests only)."""

from __future__ import annotations

import functools

import torch

from kvserve.model.registry import bundled_gguf_path


@functools.cache
def hf_model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    # Never stop early: EOS stays an ordinary token, as with ignore_eos=True on our side.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model, tokenizer


@torch.inference_mode()
def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model, _ = hf_model_and_tokenizer()
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt_ids) :].tolist()
