"""The server under pressure and at its edges: a full waiting queue, a failing iteration, draining,
a dying engine loop, and `kvserve serve` itself (API key, SIGTERM). The in-process tests share one
small engine (one running sequence, two waiting) and run in file order: the last ones leave it drained
and dead."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.openai_api import build_app
from kvserve.server.testing import ServerThread

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small() -> Iterator[AsyncEngine]:
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", max_num_seqs=1, max_waiting_requests=2))).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(small: AsyncEngine) -> Iterator[str]:
    with ServerThread(build_app(small)) as running:
        yield running.base_url


def metric(url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **body}, timeout=120)


def sse_payloads(lines: Iterator[str]) -> Iterator[str]:
    return (line[6:] for line in lines if line.startswith("data: "))


def test_full_queue_answers_429_and_admitted_requests_complete(url: str) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            bodies = [{"prompt": f"Count to ten, take {i}:", "max_tokens": 8, "ignore_eos": True} for i in range(12)]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, statuses
    for response in responses:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == 8
        else:
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error" and "queue is full" in error["message"]
    rejected = metric(url, "kvserve_http_requests_total", endpoint="/v1/completions", outcome="rejected_429")
    assert rejected == statuses.count(429)
    assert complete(url).status_code == 200  # nothing stuck behind the refusals


def test_failed_iteration_fails_its_requests_not_the_server(
    url: str, small: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = small.engine.step
    calls = 0

    def step_that_fails_once() -> list:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(small.engine, "step", step_that_fails_once)
    failed = complete(url, max_tokens=4, ignore_eos=True)
    assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
    assert complete(url).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert metric(url, "kvserve_step_failures_total") == 1
    assert metric(url, "kvserve_kv_blocks_used") == 0


def test_drain_refuses_new_work_and_aborts_what_outlives_the_timeout(url: str, small: AsyncEngine) -> None:
    body = {"prompt": "A long story:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        payloads = sse_payloads(response.iter_lines())
        next(payloads)  # generating
        drain = threading.Thread(target=asyncio.run, args=(small.drain(1.0),))
        drain.start()
        _wait_until(lambda: small.draining, 10, "draining")
        refused = complete(url)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/health").json() == {"status": "draining"}
        rest = list(payloads)
    drain.join(30)
    assert not drain.is_alive()
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    assert small.num_in_flight == 0
    assert metric(url, "kvserve_kv_blocks_used") == 0


def test_dead_engine_loop_is_reported_by_health(url: str, small: AsyncEngine) -> None:
    def crash() -> None:
        raise SystemError("injected loop failure")

    small._post(crash)  # a failure of the loop itself, not of any request
    small._thread.join(10)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "injected loop failure" in health.json()["error"]
    assert complete(url).status_code == 503
    assert metric(url, "kvserve_engine_healthy") == 0


def _wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _healthy(proc: subprocess.Popen, base: str) -> bool:
    assert proc.poll() is None, f"kvserve serve exited with {proc.returncode}"
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _cli_serve(*extra_args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`kvserve serve` (float32) in a subprocess, healthy; yields it and its base URL; killed if still up."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["serve", "--dtype", "float32", "--port", str(port), *extra_args, "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", *argv], cwd=ROOT, start_new_session=True)
    try:
        _wait_until(lambda: _healthy(proc, base), 180, "kvserve serve to become healthy")  # /health needs no key
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serve_with_api_key_drains_on_sigterm() -> None:
    with _cli_serve("--api-key", "sesame") as (proc, base):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            denied = httpx.get(f"{base}/v1/models", headers=headers)
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0)
        assert client.models.list().data[0].id == "smollm2-135m-instruct"

        stream = client.completions.create(
            model="smollm2-135m-instruct",
            prompt="Once upon a time",
            max_tokens=48,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = next(stream).choices[0].text
        proc.send_signal(signal.SIGTERM)
        _wait_until(lambda: httpx.get(f"{base}/health").status_code == 503, 10, "draining")
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="smollm2-135m-instruct", prompt="hi", max_tokens=1)
        assert refused.value.status_code == 503
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"  # the in-flight request finished
        assert len(text + "".join(c.choices[0].text for c in chunks)) > 0
        assert proc.wait(timeout=60) == 0


def _signal_thread(pid: int, tid: int, sig: int) -> None:
    """tgkill(2): deliver `sig` to one thread of `pid` (os.kill lets the kernel pick the thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    sys_tgkill = 234  # x86-64
    assert libc.syscall(sys_tgkill, pid, tid, sig) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.skipif(
    platform.machine() != "x86_64" or sys.platform != "linux", reason="tgkill's number is x86-64 Linux's"
)
def test_an_idle_server_stops_on_sigterm_whichever_thread_receives_it() -> None:
    with _cli_serve() as (proc, _):
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert others, "the server runs an HTTP thread beside the engine's"
        _signal_thread(proc.pid, max(others), signal.SIGTERM)  # the newest thread: not the main one
        assert proc.wait(timeout=20) == 0
