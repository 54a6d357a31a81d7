"""The startup report: `kvserve info` and the server's log state what the engine really chose (checked
against an engine built here with the same flags), and `kvserve serve --help` gives every flag a default."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from kvserve.cli import HelpWithDefaults, build_parser, engine_config_from_args
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.startup_report import RELEVANT_CPU_FEATURES, StartupReport, memory_summary
from kvserve.kernels import cpu
from kvserve.kernels.cpu import build_config
from kvserve.model.quantized_linear import quantized_kernels

ROOT = Path(__file__).resolve().parents[1]
# Small and unusual values, so a report that printed defaults instead of the engine's state would fail.
FLAGS = ["--num-kv-blocks", "48", "--max-model-len", "320", "--max-waiting-requests", "7", "--dtype", "float32"]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(engine_config_from_args(build_parser().parse_args(["info", *FLAGS])))


def expected_rows(engine: LLMEngine) -> dict[str, str]:
    """Rows whose values are computed here from the engine, independently of startup_report.py."""
    features = set(build_config.cpu_features())
    return {
        "dtype": "float32 (--dtype float32)",
        "attention backend": f"{engine.attention_backend} (--attention-backend auto)",
        "cpu kernels": f"{cpu.choice().source}: {cpu.choice().reason}",
        "cpu features": " ".join(f for f in RELEVANT_CPU_FEATURES if f in features) or "none of interest",
        "kv pool": f"48 blocks x 16 tokens = 768 tokens, {engine.cache.tensor.nbytes} bytes "
        f"({engine.cache.tensor.nbytes / 2**20:.1f} MiB)",
        "max sequences at full context": str(48 // math.ceil(320 / 16)),
        "max_model_len": f"320 tokens (model context {engine.model.config.max_position_embeddings})",
        "queue (max_waiting_requests)": "7",
        "quantization": f"matrices in GGUF blocks: {engine.quantization} (--quantization auto)",
    }


def test_the_cli_keeps_the_bundled_blocks_where_the_kernels_run(engine: LLMEngine) -> None:
    """The CLI's default quantization is auto (the Python API's is none)."""
    assert engine.config.quantization == "auto" and EngineConfig().quantization == "none"
    assert engine.quantization == ("Q4_1 x 120, Q8_0 x 1" if quantized_kernels() is not None else "none")


def test_the_memory_row_adds_up_the_engines_tensors(engine: LLMEngine) -> None:
    weights = engine.model.weights
    held = [weights.embed_tokens, weights.final_norm, weights.lm_head]
    held += [t for layer in weights.layers for t in vars(layer).values() if t is not None]
    distinct = {id(t): t for t in held}.values()
    blocks = sum(t.nbytes for t in distinct if not isinstance(t, torch.Tensor))
    dense = sum(t.numel() * t.element_size() for t in distinct if isinstance(t, torch.Tensor))
    kv_mib = 48 * 16 * 30 * 2 * 3 * 64 * 4 / 2**20
    row = memory_summary(engine)
    expected = (
        f"weights {(blocks + dense) / 2**20:.1f} MiB ({blocks / 2**20:.1f} in GGUF blocks, "
        f"{dense / 2**20:.1f} dense), KV pool {kv_mib:.1f} MiB; process RSS "
    )
    assert row.startswith(expected), row
    rss, peak = (int(n) for n in re.fullmatch(r".*process RSS (\d+) MiB, peak (\d+) MiB", row).groups())
    assert (blocks + dense) / 2**20 + kv_mib < rss <= peak


def test_info_prints_what_the_engine_chose(engine: LLMEngine) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "info", "--json", *FLAGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    rows = json.loads(out)
    for name, value in expected_rows(engine).items():
        assert rows[name] == value, name
    forced = os.environ.get("KVSERVE_CPU_ISA")
    assert rows["cpu path"].startswith(f"{forced or build_config.executable_isas()[-1].name} ")
    assert ("forced by KVSERVE_CPU_ISA" in rows["cpu path"]) == bool(forced)
    if not forced:  # a forced path caps ATen in the CLI's process, not in this one
        assert rows["torch cpu ops"].startswith(f"ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN up to ")
    assert rows["model"].startswith(f"{engine.model_name} (") and rows["model"].endswith(".gguf)")
    assert rows["family"].startswith("llama: 30 layers, hidden 576, 9 heads / 3 KV heads")
    assert rows["weights"].startswith("gguf: Q4_1 x ")  # the bundled checkpoint is Q4_1
    assert engine.cache.tensor.nbytes == 48 * 16 * 30 * 2 * 3 * 64 * 4  # blocks x tokens x layers x K,V x heads x dim


def test_served_log_holds_the_report_with_address_and_time_to_ready(engine: LLMEngine) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), *FLAGS],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert proc.poll() is None, "the server exited"
    finally:
        proc.terminate()
        log = proc.communicate(timeout=120)[1]
    report = StartupReport(expected_rows(engine))
    report.add("listen", f"http://127.0.0.1:{port}")
    for name, value in report.rows.items():
        assert f"{name}:" in log and value in log, (name, value, log)
    assert "time to ready:" in log and "s since the process started" in log


def serve_parser() -> argparse.ArgumentParser:
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return subcommands.choices["serve"]


def test_serve_help_names_every_flag_with_its_default() -> None:
    serve = serve_parser()
    assert serve.formatter_class is HelpWithDefaults
    text = " ".join(serve.format_help().split())  # argparse wraps lines: compare with single spaces
    formatter = serve._get_formatter()
    for action in serve._actions:
        if action.dest == "help":
            continue
        described = " ".join(formatter._expand_help(action).split())
        assert "(default:" in described, action.option_strings
        assert f"{action.option_strings[0]} " in text and described in text, action.option_strings


def test_serve_help_never_prints_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_API_KEY", "secret-key-123")
    serve = serve_parser()
    assert serve.parse_args([]).api_key == "secret-key-123"
    assert "secret-key-123" not in serve.format_help()
