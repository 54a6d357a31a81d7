"""Reading an HF config.json in either spelling: transformers 4 (top-level `rope_theta` / `rope_scaling`)
or transformers 5 (`rope_parameters`, per layer type for Gemma 3). A key the file leaves out takes the
default of the family's transformers config class (each family lists those it relies on); a value
kvserve does not implement is an error naming it and what is supported."""

from __future__ import annotations

from typing import Any

from kvserve.model.config import FULL, SLIDING
from kvserve.model.rope import ROPE_SCALINGS

_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


class HFConfig:
    """config.json's values with the family's class defaults behind them."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any], family: str) -> None:
        self.raw, self.defaults, self.family = raw, defaults, family

    def get(self, key: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ValueError(f"config.json of this {self.family} model has no {key!r}")

    def require(self, key: str, allowed: tuple[Any, ...]) -> Any:
        """The value of `key`, which must be one of `allowed` (what kvserve implements for this family)."""
        value = self.get(key)
        if value not in allowed:
            raise ValueError(f"unsupported {key}={value!r} for a {self.family} model; supported: {list(allowed)}")
        return value

    def head_dim(self) -> int:
        """`head_dim` where the file sets it, else hidden_size / num_attention_heads (transformers' rule)."""
        value = self.raw.get("head_dim", self.defaults.get("head_dim"))
        return int(value) if value else self.get("hidden_size") // self.get("num_attention_heads")

    def rope(self, layer_type: str | None = None) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
        """(rope_theta, scaling items or None) of the model, or of one layer type (Gemma 3)."""
        params = self.raw.get("rope_parameters")
        if params is not None:  # transformers 5
            if layer_type is not None:
                if layer_type not in params:
                    raise ValueError(f"rope_parameters has no entry for {layer_type!r} layers: {sorted(params)}")
                params = params[layer_type]
            params = dict(params)
        else:  # transformers 4
            theta_key = "rope_local_base_freq" if layer_type == SLIDING else "rope_theta"
            scaling = self.raw.get("rope_scaling") if layer_type in (None, FULL) else None
            params = {**(scaling or {}), "rope_theta": self.get(theta_key)}
        kind = params.pop("rope_type", params.pop("type", "default"))
        if kind not in _ROPE_KEYS:
            raise ValueError(
                f"unsupported RoPE type {kind!r} in this {self.family} config; supported: {['default', *ROPE_SCALINGS]}"
            )
        theta = float(params.pop("rope_theta"))
        extra = sorted(set(params) - _ROPE_KEYS[kind])
        # transformers 5 writes the class's defaults of these beside every RoPE type; kvserve implements
        # them only at the values that change nothing.
        for key, neutral in (("partial_rotary_factor", 1.0), ("attention_factor", None)):
            if key in extra and params[key] in (neutral, None):
                extra.remove(key)
                params.pop(key)
        if extra:
            raise ValueError(f"unsupported RoPE parameters {extra} for RoPE type {kind!r} in this {self.family} config")
        missing = sorted(_ROPE_KEYS[kind] - set(params))
        if missing:
            raise ValueError(f"RoPE type {kind!r} needs {missing} in this {self.family} config")
        scaling = None if kind == "default" else tuple(sorted({**params, "rope_type": kind}.items()))
        return theta, scaling
