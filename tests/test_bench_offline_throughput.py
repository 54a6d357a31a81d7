"""benchmarks/offline_throughput.py without vLLM: the peers' script's output is parsed, a vLLM batch runs only
on the prompts the script draws itself, every kvserve / peer ratio is taken within its round (the median of
the rounds' ratios, not a ratio of medians), and each engine's offline roofs come from its own weights."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserve.model.registry import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import offline_throughput  # noqa: E402  (benchmark scripts, importable from their folder)
import row_roofs  # noqa: E402

# What bench_vllm_offline.py prints on stdout (vLLM's own log goes to stderr), abridged.
PEER_STDOUT = """SANITY chat: 'The capital of France is Paris.' prompt_ids: [1, 9690, 198]
SANITY ids (HF fp32/bf16 greedy says "The capital of France is Paris."): 'The capital of France is Paris.'
RESULT {"engine": "vllm-cpu", "dtype": "float32", "n": 64, "in_len": 128, "out_len": 128, "enforce_eager": false, \
"load_s": 83.1, "elapsed_s": 29.47, "output_tokens": 8192, "input_tokens": 8192, "output_tok_s": 278.0, \
"total_tok_s": 556.0, "req_s": 2.172}
sample output: 'and the'
"""

# A machine with no native bf16 whose stream and GEMM rate are round figures.
SYNTHETIC_ROOFS: dict[str, Any] = {
    "native_bf16": False,
    "stream_huge": {"gb_s": 20.0},
    "gemm_bf16": {"flop_s": 1e9},
    "gemm_fp32": {"flop_s": 1e11},
}


def test_the_peer_scripts_result_line_is_parsed_with_its_sanity_lines() -> None:
    result = offline_throughput.parse_vllm_result(PEER_STDOUT)
    assert (result["elapsed_s"], result["output_tokens"], result["load_s"]) == (29.47, 8192, 83.1)
    assert result["sanity"] == PEER_STDOUT.splitlines()[:2]
    with pytest.raises(ValueError, match="no RESULT line"):
        offline_throughput.parse_vllm_result("SANITY chat: ''\nTraceback (most recent call last):\n")


def test_a_vllm_batch_runs_only_on_the_prompts_its_script_draws() -> None:
    missing = Path("/nonexistent")
    timed = offline_throughput.VllmRunner(missing / "python", missing / "script.py", missing).timed("float32", seed=0)
    ids = offline_throughput.PEER_SCRIPT_IDS
    with pytest.raises(ValueError, match="seed 0"):
        timed(offline_throughput.random_prompts(2, 8, seed=1, ids=ids), 4)
    with pytest.raises(ValueError, match="seed 0"):
        timed(offline_throughput.random_prompts(2, 8, seed=0), 4)  # the default ids: another draw
    with pytest.raises(FileNotFoundError):  # the script's own draw passes, and the (missing) interpreter is run
        timed(offline_throughput.random_prompts(2, 8, seed=0, ids=ids), 4)


def test_every_kvserve_engine_is_compared_with_every_peer_within_each_round() -> None:
    tok_s = [(300.0, 240.0, 100.0, 30.0), (330.0, 200.0, 110.0, 40.0), (200.0, 250.0, 50.0, 25.0)]
    names = ("kvserve", "kvserve-q", "vllm-cpu fp32", "vllm-cpu bf16")
    rounds = [{name: {"output_tok_s": t} for name, t in zip(names, row, strict=True)} for row in tok_s]
    ratios = offline_throughput.round_ratios(rounds)
    assert list(ratios) == [f"{ours} / {peer}" for ours in names[:2] for peer in names[2:]]
    bf16 = ratios["kvserve / vllm-cpu bf16"]
    assert bf16["per_round"] == pytest.approx([10.0, 8.25, 8.0])
    assert bf16["median"] == pytest.approx(8.25)  # the ratio of the medians would be 300 / 30 = 10
    assert ratios["kvserve-q / vllm-cpu fp32"]["per_round"] == pytest.approx([2.4, 200 / 110, 5.0])


def test_each_offline_engine_is_measured_against_its_own_weights() -> None:
    requests, prompt, output = 64, 128, 128
    weights = {
        "kvserve": row_roofs.kvserve_weights("bfloat16", "none"),
        "vllm-cpu fp32": row_roofs.PEER_WEIGHTS["fp32"],
    }
    result: dict[str, Any] = {
        "model": DEFAULT_MODEL, "num_requests": requests, "input_len": prompt, "output_len": output,
        "engines": {name: {"weights": dataclasses.asdict(w)} for name, w in weights.items()},
        "rounds": [{name: {"output_tok_s": 200.0} for name in weights}],
    }  # fmt: skip
    offline_throughput.attach_shares(result, SYNTHETIC_ROOFS)
    ours, peer = (result["engines"][name]["roof"] for name in weights)
    row = result["rounds"][0]

    # The step-bytes roof: the prompts' step reads the weights, each decode step the weights, every
    # sequence's embedding row and its K/V.
    cost = row_roofs.model_cost(DEFAULT_MODEL, weights["kvserve"])
    reads = cost.weight_bytes + sum(cost.step_bytes([n] * requests) for n in range(prompt + 1, prompt + output))
    memory_tok_s = requests * output / (reads / (SYNTHETIC_ROOFS["stream_huge"]["gb_s"] * 1e9))
    assert ours["memory_tok_s"] == pytest.approx(memory_tok_s)
    assert row["kvserve"]["share_of_step_bytes_roof"] == pytest.approx(200.0 / memory_tok_s)
    assert row["kvserve"]["share_of_roofline"] == pytest.approx(200.0 / min(memory_tok_s, ours["compute_tok_s"]))
    # float32 reads every byte bf16 does twice as wide (weights, embedding rows, K/V): half the roof, and
    # at the same speed twice the share; no native bf16, so both multiply at the float32 rate.
    assert peer["weight_bytes_per_step"] == 2 * ours["weight_bytes_per_step"]
    assert peer["memory_tok_s"] == pytest.approx(ours["memory_tok_s"] / 2)
    assert row["vllm-cpu fp32"]["share_of_step_bytes_roof"] == pytest.approx(
        2 * row["kvserve"]["share_of_step_bytes_roof"]
    )
    assert (ours["gemm"], peer["gemm"]) == ("fp32", "fp32")
    assert peer["compute_tok_s"] == pytest.approx(ours["compute_tok_s"])
