"""Load an HF directory: config.json (through its family) + *.safetensors, tensors one at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvserve.model.config import ModelConfig
from kvserve.model.families import family_for_hf
from kvserve.model.families.family import Family


def read_raw_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no config.json")
    return json.loads(path.read_text())


def read_hf_config(directory: Path) -> tuple[ModelConfig, dict[str, Any], Family]:
    raw = read_raw_config(directory)
    family = family_for_hf(raw)
    return family.config_from_hf(raw), raw, family


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} has no *.safetensors files")
    return files


def iter_hf_tensors(directory: Path, family: Family, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its HF name in `dtype`, one at a time, read through the files' mmap. Norm
    weights get the family's offset (Gemma's x * (1 + w)) added in float32 before the cast."""
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensor = f.get_tensor(name)
                if family.hf_norm_offset and name.endswith("norm.weight"):
                    tensor = tensor.float() + family.hf_norm_offset
                yield name, tensor.to(dtype)
