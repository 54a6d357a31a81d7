"""Tiny random checkpoints of each model family, made with transformers' own config and model classes
(tests only): weights drawn so attention is sharp and context-dependent (a window or RoPE mistake then
changes the output) and next-token distributions are peaked (no near-tie decides a greedy token)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 320
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
LAYER_TYPES_EVERY_SIXTH_GLOBAL = ["sliding_attention"] * 5 + ["full_attention"]
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def family_configs() -> dict:
    """transformers config objects, one per family, in transformers 5's spelling."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    llama3 = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    return {
        "llama": LlamaConfig(**_SHAPE, num_hidden_layers=2, rope_parameters=llama3),
        "mistral": MistralConfig(**_SHAPE, num_hidden_layers=2, sliding_window=WINDOW),
        "qwen2": Qwen2Config(**_SHAPE, num_hidden_layers=2, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**_SHAPE, num_hidden_layers=2, head_dim=32),
        "gemma3": _gemma3_config(LAYER_TYPES, query_pre_attn_scalar=24, sliding_rope_theta=500.0),
        # Gemma 3 as its GGUF spells it, which has no keys for these (llama.cpp's rules, gemma3.py): every
        # sixth layer global, the sliding layers' RoPE base 10,000, queries scaled by 1/sqrt(head_dim).
        "gemma3-gguf": _gemma3_config(
            LAYER_TYPES_EVERY_SIXTH_GLOBAL, query_pre_attn_scalar=32, sliding_rope_theta=10_000.0
        ),
    }


def _gemma3_config(layer_types: list[str], query_pre_attn_scalar: int, sliding_rope_theta: float):  # noqa: ANN202
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_SHAPE,
        num_hidden_layers=len(layer_types),
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=layer_types,
        query_pre_attn_scalar=query_pre_attn_scalar,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding_rope_theta},
        },
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    offset = 1.0 if "gemma" in type(model).__name__.lower() else 0.0  # Gemma's norms are x * (1 + w)
    # A tied head reads the embeddings: small ones, so the residual stream is not the input token's own
    # embedding (which would make every model repeat it), and a large final norm for peaked logits.
    tied = model.config.tie_word_embeddings
    for name, param in model.named_parameters():
        if name == "model.norm.weight" and tied:
            param.copy_(torch.randn(param.shape, generator=gen) + 10.0 - offset)
        elif "norm" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + 1.0 - offset)
        elif name.endswith("bias"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        elif "embed_tokens" in name or "lm_head" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * (0.1 if tied else 1.0))
        else:  # unit-variance products; q and k larger, so attention prefers few keys
            gain = 2.5 if ("q_proj" in name or "k_proj" in name) else 1.0
            param.copy_(torch.randn(param.shape, generator=gen) * gain / param.shape[1] ** 0.5)


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer.json over VOCAB tokens (prompts in the tests are token ids)."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))


def save_checkpoint(family: str, directory: Path, seed: int = 0):  # noqa: ANN201 (a transformers model)
    """The family's tiny model saved as safetensors + config.json + tokenizer.json; returns the HF model."""
    from transformers import AutoModelForCausalLM

    config = family_configs()[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.generation_config.eos_token_id = None  # never stop early: kvserve runs with ignore_eos
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def to_transformers4_spelling(directory: Path) -> None:
    """Rewrite config.json as transformers 4 saved it: top-level rope_theta / rope_scaling (Gemma 3:
    rope_theta for global layers, rope_local_base_freq for sliding ones)."""
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    params = raw.pop("rope_parameters")
    if "full_attention" in params:
        raw["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    params = dict(params)
    raw["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    raw["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **params}
    path.write_text(json.dumps(raw))


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of Llama's q/k rows (RoPE on adjacent pairs)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.1 scaling: per frequency, the divisor of its inverse frequency."""
    params = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (params["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old, factor = params["original_max_position_embeddings"], params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


_GEMMA3_GGUF_LAYER_NAMES = {  # llama.cpp's names for Gemma 3's four norms
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(family: str, model, path: Path, block_types: dict | None = None) -> None:
    """The HF model as llama.cpp's converter writes it, for the llama, qwen2, qwen3 and gemma3 families
    (Gemma's vocabulary as SentencePiece's, its norm weights w as 1 + w): float32 tensors, except the
    matrices `block_types` names (HF stem such as "self_attn.v_proj", or "embed_tokens" / "lm_head" ->
    GGMLQuantizationType), quantized with the gguf package's own quantizer."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    def add(writer: GGUFWriter, name: str, stem: str, array: np.ndarray) -> None:
        qtype = (block_types or {}).get(stem)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(str(path), family)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    gemma = family == "gemma3"
    rope = config.rope_parameters["full_attention"] if gemma else config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_token_list([f"w{i}" for i in range(VOCAB)])
    if gemma:
        writer.add_sliding_window(config.sliding_window)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(i) for i in range(VOCAB)])
        writer.add_token_types([1] * VOCAB)  # normal tokens
        writer.add_unk_token_id(0)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_merges([])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    layer_names = {**_GGUF_LAYER_NAMES, **_GEMMA3_GGUF_LAYER_NAMES} if gemma else _GGUF_LAYER_NAMES
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0
        if name == "model.embed_tokens.weight":
            add(writer, "token_embd.weight", "embed_tokens", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                add(writer, "output.weight", "lm_head", array)
        else:
            layer, part = name.removeprefix("model.layers.").split(".", 1)
            stem, suffix = part.rsplit(".", 1)
            if family == "llama" and stem == "self_attn.q_proj":
                array = _llama_cpp_permute(array, config.num_attention_heads)
            elif family == "llama" and stem == "self_attn.k_proj":
                array = _llama_cpp_permute(array, config.num_key_value_heads)
            add(writer, f"blk.{layer}.{layer_names[stem]}.{suffix}", stem, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
