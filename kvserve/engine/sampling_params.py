"""Per-request generation settings, validated on construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.structured.grammar import StructuredOutput

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
    # Logits processing, in vLLM's order (logits_processors.py): logit_bias, min_tokens, then the penalties.
    # Added to the logit of a token id: -100 bans it in practice, +100 forces it.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # EOS and stop_token_ids are banned until this many tokens have been generated.
    min_tokens: int = 0
    # Subtracted once from the logit of every token already generated (OpenAI's definition).
    presence_penalty: float = 0.0
    # Subtracted from a token's logit once per time it has been generated.
    frequency_penalty: float = 0.0
    # Divides positive (multiplies negative) logits of tokens in the prompt or the output; 1 = off.
    repetition_penalty: float = 1.0
    # Drop tokens whose probability (after temperature) is below min_p times the most likely one's.
    min_p: float = 0.0
    # Log-probabilities of each prompt token (the first has none) plus this many top alternatives.
    prompt_logprobs: int | None = None
    # Constrained decoding: every token must keep the output a prefix of the grammar's language, and
    # end-of-sequence is allowed exactly when it is complete (kvserve/structured).
    structured: StructuredOutput | None = None

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
            ("stop_token_ids", all(_is_token_id(t) for t in self.stop_token_ids), "token ids"),
            ("logprobs", _is_count(self.logprobs, 20), "an integer in [0, 20]"),
            ("prompt_logprobs", _is_count(self.prompt_logprobs, 20), "an integer in [0, 20]"),
            (
                "logit_bias",
                isinstance(self.logit_bias, dict)
                and all(_is_token_id(t) and _is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()),
                "a map of token ids to numbers in [-100, 100]",
            ),
            ("min_tokens", self.min_tokens is not None and _is_count(self.min_tokens, None), "an integer >= 0"),
            ("presence_penalty", _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            (
                "frequency_penalty",
                _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "in [-2, 2]",
            ),
            ("repetition_penalty", _is_number(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            (
                "structured",
                self.structured is None or isinstance(self.structured, StructuredOutput),
                "a StructuredOutput",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {short_repr(getattr(self, name))}")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # The grammar decides where the answer ends; these would fight it (a complete value allows
            # only end-of-sequence, which they forbid).
            raise ValueError("ignore_eos and min_tokens cannot be combined with structured output")

    @property
    def processes_logits(self) -> bool:
        """Whether logits_processors.py changes this request's logits."""
        return self.structured is not None or not self.speculates

    @property
    def speculates(self) -> bool:
        """Whether drafts may be verified for this request. Not with logit_bias, min_tokens or penalties:
        verification would need them applied at every draft position. A grammar is (spec/speculator.py
        masks each target row after the drafts before it)."""
        return not (
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

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


def _is_count(value: object, most: int | None) -> bool:
    """None, or an integer in [0, most]."""
    if value is None:
        return True
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (most is None or value <= most)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
