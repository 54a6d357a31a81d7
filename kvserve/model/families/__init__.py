"""The model families kvserve serves, one file each, chosen by config.json's `architectures` (or
`model_type`) or by GGUF's `general.architecture`."""

from __future__ import annotations

from typing import Any

from kvserve.model.families import gemma3, llama, mistral, qwen2, qwen3
from kvserve.model.families.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY)


def family_for_hf(raw: dict[str, Any]) -> Family:
    architectures = raw.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in architectures):
            return family
    if not architectures:
        model_type = raw.get("model_type")
        for family in FAMILIES:
            if model_type in family.hf_model_types:
                return family
    supported = sorted(a for f in FAMILIES for a in f.hf_architectures)
    raise ValueError(
        f"unsupported architecture {architectures or raw.get('model_type')!r} in config.json; supported: {supported}"
    )


def family_for_gguf(architecture: str) -> Family:
    for family in FAMILIES:
        if family.gguf_architecture == architecture:
            return family
    supported = sorted(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)
    raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: {supported}")
