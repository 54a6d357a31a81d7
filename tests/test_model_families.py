"""Every model family, as a tiny random checkpoint made by transformers itself: kvserve's greedy tokens
equal HF's `generate` in float32, one request at a time and batched, prefix caching on and off, with
prompts longer than the sliding window; both config spellings read alike; what kvserve does not
implement is refused by name."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.engine.startup_report import compiled_decode_summary
from kvserve.kernels.backends import get_attention_backend
from kvserve.model.compiled_decode import decode_model_arguments
from kvserve.model.families import family_for_hf
from kvserve.model.hf import read_hf_config
from kvserve.model.linear import gemv_kernels
from tests.family_checkpoints import (
    VOCAB,
    WINDOW,
    family_configs,
    save_checkpoint,
    to_transformers4_spelling,
    write_gguf,
)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
# Written with the gguf package's GGUFWriter, as llama.cpp's converter does: family -> the checkpoint written.
# Gemma 3's GGUF cannot say which layers are global or its sliding layers' RoPE base: a checkpoint with
# llama.cpp's fixed values. Mistral has no GGUF architecture of its own (llama.cpp writes it as "llama",
# without its window).
GGUF_CHECKPOINTS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3-gguf"}
WINDOWED = ["mistral", "gemma3"]
NEW_TOKENS = 32
_gen = torch.Generator().manual_seed(7)
_BASE = torch.randint(3, VOCAB, (44,), generator=_gen).tolist()
# Lengths 3 to 44, all but the first longer than the window; the longer ones share whole 16-token blocks
# with each other, so prefix caching has blocks to reuse.
PROMPTS = [_BASE[:3], _BASE[:20] + [5, 6, 7], _BASE, torch.randint(3, VOCAB, (17,), generator=_gen).tolist()]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """family -> (directory, HF greedy tokens per prompt)."""
    made = {}
    for name in FAMILIES + ["gemma3-gguf"]:
        directory = tmp_path_factory.mktemp(name)
        model = save_checkpoint(name, directory)
        gguf_family = next((f for f, checkpoint in GGUF_CHECKPOINTS.items() if checkpoint == name), None)
        if gguf_family is not None:  # beside the safetensors: the HF loaders read neither the other's file
            write_gguf(gguf_family, model, directory / "model.gguf")
        made[name] = (directory, [hf_greedy(model, ids) for ids in PROMPTS])
    return made


@torch.inference_mode()
def hf_greedy(model, ids: list[int]) -> list[int]:
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    return out[0, len(ids) :].tolist()


def kvserve_llm(directory: Path, **config) -> LLM:
    return LLM(model=str(directory), **{"dtype": "float32", "num_kv_blocks": 48, **config})


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_one_at_a_time_and_batched(checkpoints, family, prefix_caching):
    directory, expected = checkpoints[family]
    llm = kvserve_llm(directory, enable_prefix_caching=prefix_caching)
    alone = [llm.generate([ids], GREEDY)[0] for ids in PROMPTS]
    assert [o.token_ids for o in alone] == expected
    if prefix_caching:  # the later prompts reused the earlier ones' blocks
        assert any(o.num_cached_tokens > 0 for o in alone)
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == expected


@pytest.mark.parametrize("family", GGUF_CHECKPOINTS)
def test_gguf_of_the_checkpoint_equals_hf(checkpoints, family):
    """The same weights as llama.cpp writes them (Llama: q/k rows permuted, llama3 RoPE as rope_freqs;
    Qwen2: q/k/v biases; Qwen3: q/k norms; Gemma 3: norms stored as 1 + w, a SentencePiece vocabulary,
    the window), one at a time and batched."""
    directory, expected = checkpoints[GGUF_CHECKPOINTS[family]]
    llm = kvserve_llm(directory / "model.gguf")
    assert llm.engine.model.config.family == family
    assert [llm.generate([ids], GREEDY)[0].token_ids for ids in PROMPTS] == expected
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_windows_on_the_tiled_backend(checkpoints, family):
    """The torch tiled kernel for every layer (the engine's default here is the compiled CPU kernel;
    every backend's window against the oracle: tests/test_attention_backends.py, the compiled kernel's:
    tests/test_cpu_ops.py)."""
    directory, expected = checkpoints[family]
    outs = kvserve_llm(directory, attention_backend="tiled").generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("family", WINDOWED)
def test_the_prompts_reach_past_the_window(checkpoints, family):
    """Without its window the same checkpoint answers otherwise: the tests above see the window."""
    from transformers import AutoModelForCausalLM

    directory, expected = checkpoints[family]
    config = family_configs()[family]
    config.sliding_window = 1024
    model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    assert [hf_greedy(model, ids) for ids in PROMPTS] != expected
    assert max(len(p) for p in PROMPTS) > 4 * WINDOW


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers4_and_5_spellings_read_alike(checkpoints, family, tmp_path):
    directory, _ = checkpoints[family]
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    to_transformers4_spelling(tmp_path)
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    assert read_hf_config(tmp_path)[0] == read_hf_config(directory)[0]


def test_llama3_rope_is_read_not_defaulted(checkpoints):
    config, _, _ = read_hf_config(checkpoints["llama"][0])
    assert dict(config.rope_scaling)["rope_type"] == "llama3"
    assert dict(config.rope_scaling)["original_max_position_embeddings"] == 16


def test_gemma3_layers_have_their_own_windows_and_rope(checkpoints):
    config, _, _ = read_hf_config(checkpoints["gemma3"][0])
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert (config.rope_theta, config.sliding_rope_theta) == (50_000.0, 500.0)
    assert config.softmax_scale == 24**-0.5


def _config_with(checkpoints, family: str, tmp_path: Path, **changes) -> Path:
    raw = json.loads((checkpoints[family][0] / "config.json").read_text())
    raw.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    ("family", "changes", "named"),
    [
        ("llama", {"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ],
)
def test_unsupported_values_are_named(checkpoints, tmp_path, family, changes, named):
    directory = _config_with(checkpoints, family, tmp_path, **changes)
    with pytest.raises(ValueError, match="supported") as err:
        read_hf_config(directory)
    assert named in str(err.value)


def test_every_family_is_chosen_by_its_architecture(checkpoints):
    for family in FAMILIES:
        raw = json.loads((checkpoints[family][0] / "config.json").read_text())
        assert family_for_hf(raw).name == family


def test_startup_log_says_windows_run_on_the_compiled_kernel(checkpoints, caplog):
    if gemv_kernels() is None:
        pytest.skip("the compiled CPU kernels do not build here: every family runs on torch ops")
    caplog.set_level(logging.INFO)
    kvserve_llm(checkpoints["gemma3"][0], dtype="bfloat16")
    assert "sliding-window layers run attention on the compiled CPU kernel" in caplog.text


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_decode_step_gives_the_python_loops_tokens(checkpoints, family):
    """In bf16 every family's decode steps run as one compiled call (decode_layers.cpp) with what the
    family adds (bias, head norms, norms after attention and MLP, GELU, windows and a RoPE base per layer),
    and give the Python layer loop's tokens (that loop equals HF's above): the same kernels in the same
    order."""
    if gemv_kernels() is None:
        pytest.skip("the compiled CPU kernels do not build here")
    # No prefix caching: the second run's prompts would find the first's blocks and prefill only the rest,
    # another sum order in bf16 than the first run's whole prefill.
    llm = kvserve_llm(checkpoints[family][0], dtype="bfloat16", enable_prefix_caching=False)
    assert compiled_decode_summary(llm.engine) == "yes"  # the startup report's line
    runs = {}
    for compiled in (True, False):
        llm.engine.runner.compiled_decode = compiled
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            outs = [llm.generate([ids], GREEDY)[0].token_ids for ids in PROMPTS]
        ran = any(e.key == "kvserve::decode_layers" for e in prof.key_averages())
        runs[compiled] = (outs, ran)
    assert runs[True][1] and not runs[False][1]
    assert runs[True][0] == runs[False][0]


def test_the_compiled_step_refuses_a_q_head_norm_without_its_k_norm(checkpoints):
    """decode_layers takes each layer's extras by position (kernels.DECODE_LAYER_EXTRAS, ops.h's order): a
    q head norm whose k norm is missing is refused by name when the model's DecodeModel is built, never
    applied with another tensor."""
    if gemv_kernels() is None:
        pytest.skip("the compiled CPU kernels do not build here")
    llm = kvserve_llm(checkpoints["qwen3"][0], dtype="bfloat16", enable_prefix_caching=False)
    model, step = llm.engine.model, llm.engine.model.compiled_decode
    arguments = decode_model_arguments(model, step.kernels)
    step.kernels.DecodeModel(**arguments)  # as the model gives them: accepted
    k_norm = step.kernels.DECODE_LAYER_EXTRAS.index("k_norm")  # layer 0's, the extras being flat per layer
    assert arguments["extras"][k_norm].numel() > 0
    arguments["extras"][k_norm] = torch.empty(0)
    with pytest.raises(RuntimeError, match="layer 0 has a q head norm but no k head norm"):
        step.kernels.DecodeModel(**arguments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA with triton the backend is given")
def test_triton_takes_windowed_models_where_it_runs():
    """Its kernels compute windows (tests/test_attention_triton.py): only the missing GPU is named here."""
    with pytest.raises(ValueError, match="needs CUDA") as refused:
        get_attention_backend("triton", "cpu", windowed=True)
    assert "sliding" not in str(refused.value)


def test_configs_print_stably_for_the_fingerprint(checkpoints):
    config, _, _ = read_hf_config(checkpoints["gemma3"][0])
    assert repr(config) == repr(dataclasses.replace(config))
