"""`kvserve generate` on the bundled model: text, and --json with prompt and output ids."""

from __future__ import annotations

import json
import subprocess
import sys

from kvserve import SamplingParams


def test_generate_json_matches_offline_api(llm_fp32):
    cmd = [sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "The capital of France is"]
    cmd += ["--max-tokens", "8", "--dtype", "float32", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["prompt_ids"] == llm_fp32.tokenizer.encode("The capital of France is")
    expected = llm_fp32.generate([payload["prompt_ids"]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert payload["token_ids"] == expected.token_ids
    assert payload["text"] == expected.text


def test_generate_reports_bad_input_without_a_traceback():
    cmd = [sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "hi", "--max-tokens", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "max_tokens" in result.stderr and "Traceback" not in result.stderr
