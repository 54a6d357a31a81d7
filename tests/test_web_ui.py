"""The web page in headless Chromium (Debian's `chromium`, driven by playwright) against a live
`kvserve serve --api-key`: without the key the page gets no data; with it, a chat message streams its
answer (the same text the API gives for the same greedy request), and the live view shows that
request's iterations: its prefill tokens and decode steps, as its usage says; hidden, the page closes
its feed, and opens a new one when shown."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.server.testing import CHROMIUM, CHROMIUM_ARGS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install chromium"),
]

ROOT = Path(__file__).resolve().parents[1]
KEY = "sesame"
MAX_TOKENS = 8
QUESTION = "What is the capital of France?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """`kvserve serve --api-key` on a free port (float32, torch's CPU ops); its base URL once healthy."""
    port = _free_port()
    argv = ["serve", "--dtype", "float32", "--port", str(port), "--api-key", KEY, "--log-level", "warning"]
    env = {**os.environ, "KVSERVE_CPU_KERNELS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", *argv], cwd=ROOT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"kvserve serve exited with {proc.returncode}"
            assert time.monotonic() < deadline, "kvserve serve did not become healthy"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))
        yield browser
        browser.close()


def test_chat_streams_and_the_live_view_shows_its_iterations(server: str, browser: object) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    data_calls: list[tuple[str, int]] = []
    page.on("response", lambda r: data_calls.append((r.url, r.status)) if "/v1/" in r.url else None)

    page.goto(f"{server}/")
    page.wait_for_selector("#key-form:not([hidden])", timeout=15_000)
    assert "locked" in page.text_content("#model")
    assert data_calls and all(status == 401 for _, status in data_calls), data_calls
    assert page.locator("#requests tbody tr").count() == 0

    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_selector("#feed-status.on", timeout=15_000)
    assert "smollm2-135m-instruct" in page.text_content("#model")

    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(MAX_TOKENS))
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").first
    answer.locator(".usage").wait_for(timeout=60_000)
    assert answer.get_attribute("data-done") == "true", answer.text_content()
    text = answer.locator(".content").text_content()
    usage = answer.locator(".usage")
    prompt_tokens = int(usage.get_attribute("data-prompt-tokens"))
    cached = int(usage.get_attribute("data-cached-tokens"))
    completion = int(usage.get_attribute("data-completion-tokens"))
    assert completion == MAX_TOKENS and "TTFT" in usage.text_content() and "TPOT" in usage.text_content()

    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    expected = httpx.post(f"{server}/v1/chat/completions", headers=headers, json=body, timeout=60).json()
    assert text == expected["choices"][0]["message"]["content"] and text

    request = answer.get_attribute("data-request")
    row = page.locator(f'#requests tr[data-request="{request}"]')
    row.locator('td[data-field="state"]:text("finished")').wait_for(timeout=15_000)

    def field(name: str) -> str:
        return row.locator(f'td[data-field="{name}"]').text_content()

    assert int(field("prefill")) == prompt_tokens - cached
    assert int(field("decode")) == completion - 1, "one decode step per token after the first"
    assert int(field("steps")) == completion  # the prompt fits one step's budget
    assert "you" in (row.get_attribute("class") or "")
    decode_green = page.evaluate(
        """() => { const c = document.getElementById('timeline');
                   const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                   let n = 0; for (let i = 0; i < d.length; i += 4) n += d[i] === 58 && d[i+1] === 155 && d[i+2] === 92;
                   return n; }"""
    )
    assert decode_green > 0, "the timeline draws decode cells"

    # Hidden, the page closes its feed (the browser aborts the stream); shown again, it opens a new one.
    closed: list[str] = []
    page.on("requestfailed", lambda r: closed.append(r.url) if "/v1/engine/events" in r.url else None)
    set_hidden = """(hidden) => { Object.defineProperty(document, 'hidden', { value: hidden, configurable: true });
                                 document.dispatchEvent(new Event('visibilitychange')); }"""
    page.evaluate(set_hidden, True)
    page.wait_for_selector('#feed-status:not(.on):text("paused")', timeout=5_000)
    page.wait_for_timeout(500)
    assert len(closed) == 1 and "interval_ms=500" in closed[0], closed
    with page.expect_request(lambda r: "/v1/engine/events" in r.url, timeout=5_000):
        page.evaluate(set_hidden, False)
    page.wait_for_selector("#feed-status.on", timeout=5_000)
    assert errors == []
    page.close()
