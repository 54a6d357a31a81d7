"""LLM: the offline wrapper — submit a list of prompts, step the engine until all are done."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, cast

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.input_processor import Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import TokenizerWrapper


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._next_id = 0

    @property
    def tokenizer(self) -> TokenizerWrapper:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        cache_salt: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. One params/salt for all prompts, or a list with one each."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        # A single prompt is text or one list of token ids.
        prompts = [cast(Prompt, prompts)] if single else list(cast(Seq[Prompt], prompts))
        params_list = _per_prompt(params or SamplingParams(), len(prompts), "params", SamplingParams)
        salts = _per_prompt(cache_salt, len(prompts), "cache_salt", str)
        ids = []
        try:
            for prompt, p, salt in zip(prompts, params_list, salts, strict=True):
                request_id = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p, cache_salt=salt)
                ids.append(request_id)
            return self._run(ids)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        cache_salt: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) to one or many conversations."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [cast(list[dict[str, Any]], messages)] if single else list(cast(Seq[list], messages))
        prompts = [self.tokenizer.encode_chat(conversation) for conversation in conversations]
        return self.generate(prompts, params, cache_salt)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
        return [finished[i] for i in ids]


def _per_prompt(value: Any, count: int, name: str, kind: type) -> list[Any]:
    if value is None or isinstance(value, kind):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} must be one value or a list with one per prompt ({count}), got {len(values)}")
    return values
