"""Architecture hyper-parameters of a decoder model, read from GGUF metadata or config.json by its family
(kvserve/model/families/), whichever spelling the file uses. Every field is set from the file or from
the family's documented rule; nothing is a silent default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # the full-attention layers' RoPE base
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    # RoPE scaling of the full-attention layers ("linear" or "llama3" with their parameters), kept as a
    # sorted tuple of items so the config stays hashable and prints stably in a fingerprint.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    # GGUF's rope_freqs: per frequency, the divisor of its inverse frequency (llama.cpp's llama3 form).
    rope_freq_factors: tuple[float, ...] | None = None
    family: str = "llama"
    attention_bias: bool = False  # bias on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    activation: str = "silu"  # of the gated MLP: one of ACTIVATIONS
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)
    sliding_window: int | None = None  # keys a query sees in a sliding layer, itself included
    # Per layer SLIDING or FULL; None: every layer is SLIDING if sliding_window is set, else FULL.
    layer_types: tuple[str, ...] | None = None
    sliding_rope_theta: float | None = None  # the sliding layers' own RoPE base (Gemma 3; no scaling there)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}; supported: {list(ACTIVATIONS)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
            if unknown:
                raise ValueError(f"unsupported layer types {unknown}; supported: {[SLIDING, FULL]}")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but no sliding_window is set")

    def layer_type(self, layer: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window is not None else FULL

    def layer_window(self, layer: int) -> int | None:
        """How many keys (the query's own included) a query of this layer sees; None: all before it."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    @property
    def has_windows(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_layers))

    @property
    def window_of_every_layer(self) -> int | None:
        """The window when every layer has one (no query then sees a key that far back, so the KV cache
        may drop such keys); None when some layer attends to every key before it."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return None if None in windows else self.sliding_window

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5
