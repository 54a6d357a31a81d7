"""Per-request generation settings, validated on construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    # 0 (or anything below GREEDY_BELOW_TEMPERATURE) means greedy: argmax, the same tokens every time.
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k.
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Do not stop at end-of-sequence; EOS stays an ordinary token that may be sampled (never masked).
    ignore_eos: bool = False
    # Return the log-probability of each chosen token plus this many top alternatives (0 = chosen only).
    logprobs: int | None = None
    # Stop strings are cut from the returned text; set True to keep them.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (
                "n",
                isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
                "an integer >= 1",
            ),
            (
                "max_tokens",
                isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
                "an integer >= 1",
            ),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0, or -1 to disable"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer"),
            (
                "stop",
                all(isinstance(s, str) and s for s in self.stop),
                "a non-empty string or a list of them",
            ),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "token ids"),
            (
                "logprobs",
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                "an integer in [0, 20]",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {short_repr(getattr(self, name))}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; the distribution is one-hot anyway (as vLLM).
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def short_repr(value: object, limit: int = 80) -> str:
    """repr(value), cut to about limit characters: an error message never echoes a huge value back."""
    text = repr(value) if not isinstance(value, list | tuple | dict) or len(value) <= limit else type(value).__name__
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
