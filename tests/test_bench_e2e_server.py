"""End to end: the book's workload (token-id prompts) replayed against a live `kvserve serve`."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.bench import workload
from kvserve.bench.data import BOOK_WORKLOADS
from kvserve.bench.replay import ReplayConfig, replay
from kvserve.bench.results import build_results
from kvserve.bench.workload import WorkloadRequest

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = BOOK_WORKLOADS
START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = _free_port()
    code = "import sys; from kvserve.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["serve", "--port", str(port), "--dtype", "float32", "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"kvserve serve exited with {proc.returncode}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kvserve serve did not become healthy"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_book_workload_against_a_live_server(server: str) -> None:
    requests = workload.load(WORKLOADS / "ch31-example.jsonl")
    records, meta = replay(requests, ReplayConfig(server, ignore_eos=True, warmup=1, quiet=True))
    res = build_results(records, meta)
    assert (res["completed"], res["failed"]) == (3, 0)
    for record, request in zip(records, requests, strict=True):
        assert record.error is None and record.finish_reason == "length"
        assert record.output_len == request.max_tokens  # counted from the server's usage
        assert record.count_source == "usage"
        assert record.input_len == len(request.input_ids)
        assert record.sent >= record.arrival - 0.01
        assert record.token_times == sorted(record.token_times) and record.token_times[0] > record.sent
    assert res["tpot_missing"] == ["C"] and res["total_output_tokens"] == 6


@pytest.mark.slow
def test_chat_endpoint_and_max_concurrency(server: str) -> None:
    requests = [WorkloadRequest(f"q{i}", 0, 4, prompt=f"Name a city, {i}.", ignore_eos=True) for i in range(3)]
    cfg = ReplayConfig(server, endpoint="chat", max_concurrency=1, quiet=True)
    records, _ = replay(requests, cfg)
    assert all(r.ok and r.output_len == 4 for r in records)
    spans = sorted((r.sent, r.token_times[-1]) for r in records)
    assert all(prev_end <= start for (_, prev_end), (start, _) in zip(spans, spans[1:], strict=False))
