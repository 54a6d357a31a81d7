"""Failures on the request path, in-process with a stub engine client (no model run): an unexpected
exception is a short 500 that closes its connection, and the client's next request on a new one is
served; error bodies are cut short; the CLI names the file it could not read."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from kvserve.cli import main
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.registry import load_tokenizer
from kvserve.server.engine_client import RequestStream
from kvserve.server.errors import MAX_MESSAGE_CHARS
from kvserve.server.openai_api import build_app
from kvserve.server.testing import ServerThread


class FailingEngine:
    """An EngineClient whose submit fails in a way no handler maps: a kvserve bug, as the server sees it."""

    error = None
    draining = False
    model_name = "stub"
    max_model_len = 2048
    max_sequence_len = 1024
    quantization = "none"

    def __init__(self) -> None:
        self.tokenizer = load_tokenizer("smollm2-135m-instruct")
        self.submitted: list[list[int]] = []

    async def submit(self, request_id: str, prompts: Sequence[Any], params: SamplingParams, *_: Any) -> RequestStream:
        self.submitted.extend(prompts)
        await asyncio.sleep(0)
        raise KeyError("injected bug")

    def release(self, stream: RequestStream) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}


@pytest.fixture(scope="module")
def stub() -> FailingEngine:
    return FailingEngine()


def test_unexpected_exception_is_a_500_that_closes_the_connection(stub: FailingEngine) -> None:
    with ServerThread(build_app(stub)) as server, httpx.Client(base_url=server.base_url) as client:
        first = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert first.status_code == 500 and first.headers["connection"] == "close"
        assert first.json()["error"]["message"] == "internal server error: KeyError"
        second = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert second.status_code == 500  # a fresh connection: no broken keep-alive
        assert stub.submitted[-1] == stub.tokenizer.encode("hi")  # the engine is handed token ids


def test_error_bodies_never_echo_a_large_value(stub: FailingEngine) -> None:
    with ServerThread(build_app(stub)) as server:
        body = {"prompt": "hi", "stop": ["s"] * 3, "logit_bias": {"k" * 100_000: 1}}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body)
        assert response.status_code == 400
        assert len(response.json()["error"]["message"]) <= MAX_MESSAGE_CHARS + 40
        assert "logit_bias" in response.json()["error"]["message"]


def test_cli_errors_name_the_file(tmp_path, capsys) -> None:
    not_json = tmp_path / "some.csv"
    not_json.write_text("a,b\n1,2\n")
    assert main(["bench", "plot", str(not_json)]) == 2
    assert f"{not_json}: expected a results JSON file" in capsys.readouterr().err
    assert main(["bench", "compare", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
