"""A screenshot of the web page while a running `kvserve serve` answers a load: the page sends one chat
message of its own, then N streaming chat requests arrive in waves of 8, each wave once the previous one
has its first tokens (a shared system prompt, so the later waves hit the prefix cache; different
lengths, so requests finish while others run), and headless Chromium takes the picture once a quarter
of them have finished.

    python scripts/web_ui_screenshot.py --url http://127.0.0.1:8000 [--key KEY] [--requests 32] --out page.png
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import httpx
from playwright.sync_api import sync_playwright

from kvserve.server.testing import CHROMIUM, CHROMIUM_ARGS

SYSTEM = "You are a concise travel assistant. Answer in two or three sentences, with one practical tip."
CITIES = ["Paris", "Kyoto", "Lima", "Oslo", "Cairo", "Hanoi", "Quebec", "Porto"]


async def load(url: str, key: str | None, requests: int, finished: list[int]) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answering: list[int] = []  # requests that have their first chunk

    async def one(client: httpx.AsyncClient, i: int) -> None:
        while len(answering) < 8 * (i // 8):
            await asyncio.sleep(0.05)
        city = CITIES[i % len(CITIES)]
        body = {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What to see in {city}?"}],
            "max_tokens": 24 + 8 * (i % 10),
            "temperature": 0.8,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and i not in answering:
                    answering.append(i)
        finished.append(i)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(requests)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if CHROMIUM is None:
        raise SystemExit("needs Debian's chromium: apt-get install chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))
        page = browser.new_page(viewport={"width": 1500, "height": 1150})
        page.goto(f"{args.url}/" + (f"#key={args.key}" if args.key else ""))
        page.wait_for_selector("#feed-status.on", timeout=60_000)
        page.fill("#max_tokens", "96")
        page.fill("#prompt", "Plan a rainy afternoon in Paris.")
        page.press("#prompt", "Enter")
        finished: list[int] = []
        traffic = load(args.url, args.key, args.requests, finished)
        loader = threading.Thread(target=asyncio.run, args=(traffic,))
        loader.start()
        while len(finished) < args.requests // 4 and loader.is_alive():
            time.sleep(0.2)
        time.sleep(1.0)  # the page draws at most every event interval
        page.screenshot(path=args.out, full_page=True)
        print(f"screenshot with {len(finished)} of {args.requests} requests finished: {args.out}")
        loader.join()
        browser.close()


if __name__ == "__main__":
    main()
