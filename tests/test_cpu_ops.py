"""The compiled CPU kernels (kvserve/kernels/cpu/*.cpp) against the torch definitions they replace
(kvserve/model/layer_ops.py, F.linear) and, for attention, against the materialized oracle."""

from __future__ import annotations

import logging
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu
from kvserve.kernels.attention_cpu import BF16_PREFILL_MAX_KEYS, WIDENED_PREFILL_MAX_KEYS, cpu_attention
from kvserve.kernels.attention_ref import climbing_score_inputs, paged_reference_attention, random_paged_inputs
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.model import linear
from kvserve.model.config import ModelConfig
from kvserve.model.layer_ops import TorchLayerOps, layer_ops_for
from kvserve.model.linear import AMX_MAX_ROWS, make_linear, pack_tiles
from kvserve.model.llama import rope_tables

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    built = cpu.load()
    assert built is not None, "the CPU kernels must build on the machines kvserve is tested on"
    return built


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """float32: summation order only (1e-6 relative); bfloat16: one rounding of the same float32 value
    can land one bf16 step (2^-8 relative) away."""
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    return bool(((a.float() - b.float()).abs() <= tol * b.float().abs() + tol).all())


def test_layer_ops_pick_the_kernels_on_the_cpu(kernels) -> None:
    assert layer_ops_for(torch.device("cpu")) is kernels
    assert layer_ops_for(torch.device("meta")) is TorchLayerOps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta_kind", ["none", "plain", "normed"])
def test_add_rms_norm(kernels, dtype: torch.dtype, delta_kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(37, 576, generator=gen) * 3
    delta = (torch.randn(37, 576, generator=gen) * 5).to(dtype) if delta_kind != "none" else None
    weight = torch.rand(576, generator=gen) + 0.5
    delta_weight = torch.rand(576, generator=gen) + 0.5 if delta_kind == "normed" else None
    ours, theirs = residual.clone(), residual.clone()
    out = kernels.add_rms_norm(ours, delta, weight, 1e-5, dtype, delta_weight)
    ref = TorchLayerOps.add_rms_norm(theirs, delta, weight, 1e-5, dtype, delta_weight)
    assert out.dtype == dtype and out.shape == ref.shape
    if delta_weight is None:
        assert torch.equal(ours, theirs)  # the residual update is one float32 add either way
    else:  # the delta's norm: float32 summation order
        assert close(ours, theirs, torch.float32) and not torch.equal(ours, residual)
    assert close(out, ref, dtype)


def test_add_rms_norm_refuses_a_delta_weight_without_a_delta(kernels) -> None:
    with pytest.raises(RuntimeError, match="delta_weight needs a delta"):
        kernels.add_rms_norm(torch.zeros(2, 64), None, torch.ones(64), 1e-5, torch.float32, torch.ones(64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_rms_norm(kernels, dtype: torch.dtype) -> None:
    """Gemma 3 270M's heads (4 q, 1 kv, D 256): q and k heads normalized, v untouched."""
    hq, hkv, d = 4, 1, 256
    gen = torch.Generator().manual_seed(4)
    qkv = (torch.randn(9, (hq + 2 * hkv) * d, generator=gen) * 4).to(dtype)
    q_weight, k_weight = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
    ours, theirs = qkv.clone(), qkv.clone()
    kernels.head_rms_norm(ours, hq, hkv, q_weight, k_weight, 1e-6)
    TorchLayerOps.head_rms_norm(theirs, hq, hkv, q_weight, k_weight, 1e-6)
    assert close(ours, theirs, dtype)
    assert torch.equal(ours[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :])
    heads = ours[:, : (hq + hkv) * d].float().view(9, hq + hkv, d)
    rms = (heads / torch.cat([q_weight.expand(hq, d), k_weight.expand(hkv, d)])).pow(2).mean(-1).sqrt()
    assert bool(((rms - 1).abs() < 0.02).all())  # each head now of unit RMS before its weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(kernels, dtype: torch.dtype) -> None:
    config = ModelConfig(49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192)  # SmolLM2-135M's shapes
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    cos, sin = rope_tables(config, 4096, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    t = 21
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=gen)
    slots = torch.randperm(8 * 16, generator=gen)[:t]
    caches = [torch.zeros(8, 16, hkv, d, dtype=dtype) for _ in range(4)]
    ours, theirs = qkv.clone(), qkv.clone()
    kernels.rope_write_kv(ours, positions, cos, sin, caches[0], caches[1], slots, hq, hkv)
    TorchLayerOps.rope_write_kv(theirs, positions, cos, sin, caches[2], caches[3], slots, hq, hkv)
    assert close(ours, theirs, dtype)
    assert close(caches[0], caches[2], dtype) and torch.equal(caches[1], caches[3])
    written = caches[0].view(-1, hkv * d)[slots]
    assert torch.equal(written, ours[:, hq * d : (hq + hkv) * d])  # k rotated, as in qkv
    assert int((caches[0] != 0).flatten(1).any(1).sum()) <= 8  # nothing outside the slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_over_the_whole_range(kernels, dtype: torch.dtype) -> None:
    """Against gelu's tanh form in float64 as g * sigmoid(2u), which is 0.5 g (1 + tanh(u)) without its
    cancellation for negative g (torch's float32 gelu loses every digit there)."""
    gate = torch.linspace(-120, 120, 24000).view(3, -1)
    gate_up = torch.cat([gate, torch.randn(gate.shape, generator=torch.Generator().manual_seed(3))], 1).to(dtype)
    out = kernels.gelu_tanh_mul(gate_up)
    g, up = gate_up.double().chunk(2, dim=-1)
    ref = g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)) * up
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    # float32: u's own rounding (its cube) moves the result by up to ~1e-5 relative where g is near -10.
    tol = 2e-5 if dtype == torch.float32 else 2**-7
    assert bool(((out.double() - ref).abs() <= tol * ref.abs() + 1e-30).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_over_the_whole_range(kernels, dtype: torch.dtype) -> None:
    gate = torch.linspace(-120, 120, 24000).view(3, -1)
    gate_up = torch.cat([gate, torch.randn(gate.shape, generator=torch.Generator().manual_seed(3))], 1).to(dtype)
    out, ref = kernels.silu_mul(gate_up), TorchLayerOps.silu_mul(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    # exp is a polynomial here and Sleef's in torch: a few float32 ulps apart.
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert bool(((out.float() - ref.float()).abs() <= tol * ref.float().abs() + 1e-30).all())


@pytest.mark.parametrize("rows", [1, 64])
def test_kernels_release_the_gil_for_more_rows_than_a_gemv_takes(kernels, rows: int) -> None:
    """A Python thread runs while a kernel computes more than GEMV_MAX_ROWS rows (bindings.cpp:
    without_gil_when_long), and not while it computes fewer. With the GIL held, another thread's Python
    runs only at the edges of a call (between the caller's bytecodes, for a few switch intervals), not
    in the middle half of a call 200 intervals long. The kernel runs on one thread, so that the other
    thread has a core of its own and the edges stay short. One exception: where the OS preempts the
    ticking thread while it holds the GIL, the caller waits for it before the call starts, and that wait
    can reach into the call's middle (a clean-clone CI run once saw it). It hits a call, not most of
    them, so a held GIL lets at most a quarter of the calls see a tick in their middle; a released one
    lets the ticker run through every call."""
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(1e-4)
    torch.set_num_threads(1)
    try:
        width = 2**16
        while True:  # a silu_mul that lasts 200 switch intervals on this path
            gate_up = torch.randn(rows, width)
            started = time.perf_counter()
            kernels.silu_mul(gate_up)
            if time.perf_counter() - started >= 200 * sys.getswitchinterval() or rows * width >= 2**26:
                break
            width *= 2
        calls, stamps = calls_beside_a_ticking_thread(lambda: kernels.silu_mul(gate_up), 8)
    finally:
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
    middles = [(a + (b - a) / 4, b - (b - a) / 4) for a, b in calls]
    ticked = sum(any(lo < t < hi for t in stamps) for lo, hi in middles)  # calls with a tick in their middle
    if rows > kernels.GEMV_MAX_ROWS:
        assert ticked > 0, f"no tick of another thread fell inside {len(calls)} calls of {rows} x {width}"
    else:
        assert ticked <= len(calls) // 4, f"ticks fell inside {ticked} of {len(calls)} calls of {rows} x {width}"


def calls_beside_a_ticking_thread(call, times: int) -> tuple[list[tuple[float, float]], list[float]]:
    """(start, end) of each of `times` calls, and the perf_counter readings of a thread that reads it
    in a loop meanwhile."""
    stamps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    calls = []
    try:
        for _ in range(times):
            started = time.perf_counter()
            call()
            calls.append((started, time.perf_counter()))
    finally:
        done.set()
        ticker.join()
    return calls, stamps


CASES = [
    # (query_lens, seq_lens): decode, verify (several new tokens), partial and exact blocks, a fresh
    # 1-token sequence, and prefill chunks: 40/40 and 12/500 run on the kernel (on SDPA on the generic path),
    # 30/1100 on SDPA everywhere.
    ([1, 1, 1], [1, 16, 17]),
    ([1, 4, 8, 1, 3], [90, 4, 100, 33, 300]),
    ([2, 40, 1, 12, 30], [2, 40, 257, 500, 1100]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("query_lens", "seq_lens"), CASES)
def test_cpu_attention_matches_the_oracle(kernels, dtype, query_lens, seq_lens) -> None:
    q, k, v, meta = random_paged_inputs(query_lens, seq_lens, 9, 3, 64, 16, dtype)
    # The model hands attention q as a strided view into its fused qkv rows.
    qkv = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 2 * 3 * 64, dtype=dtype)], 1)
    strided_q = qkv[:, : 9 * 64].view(q.shape)
    out = cpu_attention(strided_q, k, v, meta, 0.125)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
    assert out.dtype == dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_rows_take_a_vector_kernel_up_to_its_bound(kernels, dtype) -> None:
    """With AMX off, a sequence with prefill rows runs on a vector kernel while it has at most that kernel's
    bound of keys and on SDPA past it: bf16 on AVX512-BF16 up to BF16_PREFILL_MAX_KEYS, elsewhere (float32 over
    widened tiles) up to WIDENED_PREFILL_MAX_KEYS; on the generic path, whose widened kernel has no vector loop,
    always on SDPA. Both give the oracle's rows."""
    isa = cpu_isa.selected()
    bound = BF16_PREFILL_MAX_KEYS if isa.bf16 and dtype == torch.bfloat16 else WIDENED_PREFILL_MAX_KEYS
    q, k, v, meta = random_paged_inputs([20, 20], [bound, bound + 1], 9, 3, 64, 16, dtype, seed=3)
    previous_amx = kernels.set_amx_attention(False)
    try:
        out = cpu_attention(q, k, v, meta, 0.125).double()
    finally:
        kernels.set_amx_attention(previous_amx)
    expected_on_kernel = [] if isa.isa.name == "generic" else [0]
    on_kernel, on_sdpa = meta.plans[("cpu", True)]
    assert on_kernel.tolist() == expected_on_kernel
    assert on_sdpa == [i for i in range(2) if i not in expected_on_kernel]
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
    assert ((out - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


# (heads, kv_heads, head_dim, block_size); the last: Gemma 3 270M's 4 query heads of 256 on one KV head.
HEAD_SHAPES = [(4, 2, 40, 8), (2, 2, 96, 32), (8, 1, 128, 16), (4, 1, 256, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), HEAD_SHAPES)
def test_cpu_attention_other_head_shapes(kernels, dtype, heads, kv_heads, head_dim, block_size) -> None:
    """Head dims that are not a multiple of the bf16 dot product's 32 (40) or of 16 floats (40: padded
    accumulators), blocks shorter than a tile (8) and longer (32), no GQA and GQA 8:1."""
    q, k, v, meta = random_paged_inputs([1, 5, 1], [37, 70, 1], heads, kv_heads, head_dim, block_size, dtype, seed=3)
    scale = head_dim**-0.5
    out = cpu_attention(q, k, v, meta, scale)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, scale, torch.float64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


# (query_lens, seq_lens, window), block size 16: windows smaller than the context starting at a block's
# first key (seq 100, window 20: the decode row sees 80..99), mid-tile, one key (itself only), exactly a
# block (16); equal to the context (37) and larger (1000); verify rows whose windows start in different
# tiles; a 40-token prefill chunk (past DECODE_MAX_QUERY_LEN: on a vector kernel, or SDPA on the generic path).
WINDOW_CASES = [
    ([1, 1, 1], [100, 37, 5], 20),
    ([1, 3, 1], [71, 64, 18], 16),
    ([1, 1], [37, 37], 37),
    ([1, 4], [37, 90], 1000),
    ([1, 2], [50, 33], 1),
    ([4, 8, 1], [90, 100, 130], 13),
    ([40, 1], [300, 257], 50),
]
# (heads, kv_heads, head_dim, block_size): Gemma 3 270M (GQA 4:1 of 256), GQA 4:1 of 128, SmolLM2's
# shape (AMX's head dim: a windowed layer must still take the vector kernel there), blocks shorter
# and longer than a tile.
WINDOW_SHAPES = [(4, 1, 256, 16), (8, 2, 128, 16), (9, 3, 64, 16), (4, 2, 40, 8), (4, 1, 64, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("query_lens", "seq_lens", "window"), WINDOW_CASES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), WINDOW_SHAPES)
def test_cpu_attention_with_a_window_matches_the_oracle(
    kernels, dtype, query_lens, seq_lens, window, heads, kv_heads, head_dim, block_size
) -> None:
    q, k, v, meta = random_paged_inputs(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=11)
    scale = head_dim**-0.5
    out = cpu_attention(q, k, v, meta, scale, window=window)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, scale, torch.float64, window)
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_with_a_window_never_uses_the_blocks_before_it(kernels, dtype) -> None:
    """Every key of the blocks wholly before a sequence's earliest window set to NaN: any use of them
    (a probability of 0 times a NaN value included) would show in the output."""
    query_lens, seq_lens, window, block_size = [1, 3], [100, 75], 20, 16
    q, k, v, meta = random_paged_inputs(query_lens, seq_lens, 4, 1, 256, block_size, dtype, seed=2)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 1 / 16, torch.float64, window)
    for i, (n, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        earliest = s - n - window + 1  # the first new token's first key
        outside = meta.block_tables[i, : earliest // block_size]
        assert len(outside) > 0
        k[outside] = float("nan")
        v[outside] = float("nan")
    out = cpu_attention(q, k, v, meta, 1 / 16, window=window)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_is_stable_for_huge_logits(kernels, dtype) -> None:
    """Scores of +-1e4 would overflow a naive exp: the online max keeps every term <= 1."""
    q, k, v, meta = random_paged_inputs([1, 3], [200, 70], 9, 3, 64, 16, dtype, seed=5)
    q = q * 400  # rounded to dtype here, so the reference sees the same input
    out = cpu_attention(q, k, v, meta, 0.125)
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 0.125, torch.float64)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_max(kernels, dtype) -> None:
    """First maximal index, ties included; -inf rows; NaN counts as the maximum (the first one wins),
    whether it lies in the vector body or the tail; rows with a stride; vocab below one vector."""
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(shape, generator=gen) for shape in ((100, 49152), (1, 49152), (3, 17), (5, 1), (7, 33))]
    cases.append(torch.randint(0, 3, (50, 1000), generator=gen).float())  # many ties
    all_inf = torch.full((4, 100), float("-inf"))
    all_inf[1, 50] = 0
    cases.append(all_inf)
    nans = torch.randn(4, 100, generator=gen)
    nans[0, 37] = nans[0, 60] = nans[2, 99] = nans[3, 0] = float("nan")
    cases.append(nans)
    cases.append(torch.randn(10, 200, generator=gen)[:, 3:150])
    for logits in cases:
        logits = logits.to(dtype)
        assert torch.equal(kernels.argmax_rows(logits), logits.max(dim=-1).indices)


AMX_CASES = [
    # (query_lens, seq_lens, head_dim, block_size): decode at step and block edges, verify rows of 1-8
    # tokens (24 rows: two 16-row chunks), a fresh 1-token sequence, head dim 32, 32-key blocks.
    ([1, 1, 1, 1], [1, 16, 32, 33], 64, 16),
    ([1, 4, 8, 1, 3, 6], [90, 4, 100, 33, 300, 64], 64, 16),
    ([1, 5, 2], [37, 70, 130], 32, 32),
    # Prefill rows on the AMX kernel (at most AMX_PREFILL_MAX_KEYS keys), whose chunks of 8 or more rows
    # take the softmax across rows: whole prompts of 1 and 4 row chunks' worth and beyond, a chunk
    # continuing a cached prefix, next to decode rows; and a sequence over the limit, which goes to SDPA
    # in the same call.
    ([128, 1, 21, 50, 9], [128, 200, 21, 250, 9], 64, 16),
    ([300, 1], [300, 40], 64, 16),
    ([600, 1], [600, 40], 64, 16),
]


@pytest.fixture
def amx(kernels):
    if not kernels.amx_available():
        pytest.skip("no AMX-BF16 on this CPU, or a lower path forced (KVSERVE_CPU_ISA)")
    yield kernels
    kernels.set_amx_attention(True)


@pytest.mark.parametrize(("query_lens", "seq_lens", "head_dim", "block_size"), AMX_CASES)
def test_amx_attention_matches_the_oracle_and_the_vector_kernel(amx, query_lens, seq_lens, head_dim, block_size):
    q, k, v, meta = random_paged_inputs(query_lens, seq_lens, 9, 3, head_dim, block_size, torch.bfloat16, seed=7)
    scale = head_dim**-0.5
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, scale, torch.float64)
    outs = []
    for use_amx in (True, False):
        amx.set_amx_attention(use_amx)
        outs.append(cpu_attention(q, k, v, meta, scale).double())
    for out in outs:
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    # The two kernels differ only in rounding (bf16 probabilities in the AMX products).
    assert ((outs[0] - outs[1]).norm() / ref.norm()).item() < 1e-2
    assert not torch.equal(outs[0], outs[1]), "both runs took the same kernel"


@pytest.mark.parametrize("query_lens", [[1, 2], [40, 100]], ids=["row by row", "across rows"])
def test_amx_attention_rescales_when_later_keys_score_higher(amx, query_lens) -> None:
    """Scores that climb along the sequence move the running max after the first step, by more than
    the lazy-rescale threshold (climbing_score_inputs). Decode-sized chunks take the softmax row by
    row, prefill chunks across rows."""
    q, k, v, meta = climbing_score_inputs(query_lens, [300, 200])
    ref = paged_reference_attention(q.double(), k.double(), v.double(), meta, 1.0, torch.float64)
    out = cpu_attention(q, k, v, meta, 1.0).double()
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


# The GEMV has no portable form: on the generic path (KVSERVE_CPU_ISA=generic, kernels/cpu/isa.py) it refuses.
needs_gemv = pytest.mark.skipif(
    linear.gemv_kernels() is None, reason="the bf16 GEMV needs AVX512-BF16 or AVX2 and FMA, and this build has neither"
)


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (37, 1536), (3, 32)])
def test_gemv_matches_a_float32_product(kernels, rows, out_features, in_features) -> None:
    """bf16 x bf16 products are exact in float32, so the result is the float32 product rounded once
    (up to float32 summation order). 37 rows leave a tail after the 4-row groups."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    out = kernels.gemv_bf16(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert close(out, F.linear(x.float(), weight.float()), torch.bfloat16)


@needs_gemv
def test_gemv_refuses_what_it_cannot_compute(kernels) -> None:
    weight = torch.ones(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="rows"):
        kernels.gemv_bf16(torch.ones(kernels.GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.gemv_bf16(torch.ones(1, 64), weight.float())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.gemv_bf16(torch.ones(1, 48, dtype=torch.bfloat16), torch.ones(4, 48, dtype=torch.bfloat16))


needs_amx = pytest.mark.skipif(cpu.load() is None or not cpu.load().amx_available(), reason="linear_amx needs AMX-BF16")
needs_tiles_fma = pytest.mark.skipif(
    cpu.choice().isa.isa.name == "generic", reason="linear_tiles_fma needs AVX2 and FMA"
)
needs_bf16_pairs = pytest.mark.skipif(
    cpu.load() is None or not cpu.load().TILES_HAVE_BF16_PAIRS, reason="the tiles' VDPBF16PS form needs AVX512-BF16"
)
# The kernels over pack_tiles' layout: linear_amx where the CPU has AMX, linear_tiles_fma on every AVX2 build in
# its float32 form and, with AVX512-BF16, in its VDPBF16PS form (set_tile_products).
TILE_KERNELS = [
    pytest.param("linear_amx", marks=needs_amx),
    pytest.param("linear_tiles_fma", marks=needs_tiles_fma),
    pytest.param("linear_tiles_fma on VDPBF16PS", marks=needs_bf16_pairs),
]


@pytest.fixture
def tile_product(kernels, tile_kernel):
    """The kernel `tile_kernel` names, its form set for the test; the process's settings restored after."""
    previous = kernels.tile_products()
    name, _, form = tile_kernel.partition(" on ")
    kernels.set_tile_products(previous[0], previous[1], form == "VDPBF16PS")
    yield getattr(kernels, name)
    kernels.set_tile_products(*previous)


@pytest.mark.parametrize("tile_kernel", TILE_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 5, 12, 13, 16, 17, 31, 32, 33, 47, 100, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (64, 32)])
def test_tile_kernels_match_a_float32_product(tile_product, rows, out_features, in_features) -> None:
    """Row counts around linear_amx's 16-row tiles (under 32 rows the last configured as tall as its rows,
    from 32 on the last overlapping the one before) and 32-row blocks and linear_tiles_fma's register
    blocks (12 rows with AVX-512, 5 with AVX2), with their tails; the float32 product rounded once to
    bf16, as for the GEMV. A misplaced element in the packed layout would be a wrong product, far outside
    one bf16 step."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    out = tile_product(x, pack_tiles(weight))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert close(out, F.linear(x.float(), weight.float()), torch.bfloat16)


@pytest.mark.parametrize("tile_kernel", TILE_KERNELS)
@pytest.mark.parametrize("rows", [3, 13, 100])
def test_tile_kernels_gate_in_their_epilogue(tile_product, rows) -> None:
    """gated: the weight [gate; up] interleaved in 16s gives silu(gate) * up, [rows, N / 2], each value
    rounded once to bf16 from the float32 products."""
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(2 * 320, 576, generator=gen) / 24).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = tile_product(x, pack_tiles(linear._interleave_halves(weight)), True)
    assert out.shape == (rows, 320)
    assert bool(((out.float() - expected).abs() <= 2**-7 * expected.abs() + 1e-4).all())


@pytest.mark.parametrize("tile_kernel", TILE_KERNELS)
def test_tile_kernels_refuse_what_they_cannot_compute(tile_product) -> None:
    packed = pack_tiles(torch.ones(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        tile_product(torch.ones(4, 64), packed)
    with pytest.raises(RuntimeError, match="columns"):
        tile_product(torch.ones(4, 96, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="packed"):
        tile_product(torch.ones(4, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16))


@pytest.fixture
def fresh_batched_product(monkeypatch):
    """The process's choice of batched product made again after the test (which forces its own through
    monkeypatch's environment, undone first), the quantized products' settings with it."""
    yield
    monkeypatch.undo()
    linear.batched_products.cache_clear()
    linear.batched_products()


@pytest.mark.skipif(
    cpu.load() is None or cpu.load().amx_available() or cpu.choice().isa.isa.name == "generic",
    reason="the batched product is chosen only where the kernels have FMA tiles and the CPU no AMX",
)
def test_kvserve_batched_product_forces_the_kernel_of_batched_rows(kernels, monkeypatch, fresh_batched_product) -> None:
    """Without AMX, KVSERVE_BATCHED_PRODUCT=fma (and =dpbf16 where the build has AVX512-BF16) packs tiles
    for linear_tiles_fma in that form and gives them prefill chunks past AMX_MAX_ROWS too, onednn leaves the
    rows to oneDNN (all agree with the float32 product), the quantized products follow
    (set_tile_products), and any other value is refused, naming the variable."""
    weight = torch.randn(64, 96).bfloat16()
    settings = [("fma", True), ("onednn", False)] + ([("dpbf16", True)] if kernels.TILES_HAVE_BF16_PAIRS else [])
    for setting, tiled in settings:
        monkeypatch.setenv(linear.BATCHED_PRODUCT_ENV, setting)
        linear.batched_products.cache_clear()
        product = make_linear(weight)
        assert (product.tiles is not None) == tiled
        assert (product.tiles_max_rows is None) == tiled
        assert kernels.tile_products() == (tiled, tiled, setting == "dpbf16")
        for rows in (7, AMX_MAX_ROWS + 88):
            x = torch.randn(rows, 96).bfloat16()
            assert close(product(x), F.linear(x.float(), weight.float()), torch.bfloat16)
    refused = ["amx"] + ([] if kernels.TILES_HAVE_BF16_PAIRS else ["dpbf16"])
    for setting in refused:
        monkeypatch.setenv(linear.BATCHED_PRODUCT_ENV, setting)
        linear.batched_products.cache_clear()
        with pytest.raises(ValueError, match="KVSERVE_BATCHED_PRODUCT"):
            make_linear(weight)


@pytest.mark.skipif(
    cpu.load() is None or cpu.load().amx_available() or cpu.choice().isa.isa.name == "generic",
    reason="the batched product is probed only where the kernels have FMA tiles and the CPU no AMX",
)
def test_the_probe_picks_a_kernel_it_timed_and_sets_the_quantized_products_to_match(
    kernels, monkeypatch, fresh_batched_product, caplog
) -> None:
    """KVSERVE_BATCHED_PRODUCT=auto times every candidate on this CPU (its log line names each), picks one
    of them, and sets quant_linear's products to the faster tile form of those it timed: the chosen kernel's
    where it is a tile form, else (oneDNN, which has no product of quantized weights) the faster of the two."""
    monkeypatch.setenv(linear.BATCHED_PRODUCT_ENV, "auto")
    linear.batched_products.cache_clear()
    with caplog.at_level(logging.INFO, logger="kvserve.model.linear"):
        choice = linear.batched_products()
    probe = next(r.getMessage() for r in caplog.records if "bf16 products of 64" in r.getMessage())
    candidates = ["fma", "onednn"] + (["dpbf16"] if kernels.TILES_HAVE_BF16_PAIRS else [])
    assert all(f"ms on {name}" in probe for name in candidates), probe
    assert choice.kernel in candidates
    forms = [name for name in candidates if name != "onednn"]
    assert choice.panels in forms and (choice.kernel == "onednn" or choice.panels == choice.kernel)
    assert kernels.tile_products() == (True, choice.long_chunks, choice.panels == "dpbf16")
    assert not choice.long_chunks or choice.kernel != "onednn"


@pytest.mark.skipif(
    cpu.load() is None or cpu.load().amx_available() or cpu.choice().isa.isa.name == "generic",
    reason="the batched product is probed only where the kernels have FMA tiles and the CPU no AMX",
)
def test_quantized_panels_keep_the_faster_tile_form_where_onednn_wins_the_probe(
    kernels, monkeypatch, fresh_batched_product
) -> None:
    """Where oneDNN wins the probe, dense batches take it, and quant_linear (which oneDNN cannot run) takes
    the tiles in the form the probe timed faster, not its other product: each form winning in turn."""
    monkeypatch.setenv(linear.BATCHED_PRODUCT_ENV, "auto")
    forms = ["fma"] + (["dpbf16"] if kernels.TILES_HAVE_BF16_PAIRS else [])
    for faster in forms:
        times = {"onednn": 1.0, **{form: 2.0 if form == faster else 3.0 for form in forms}}
        monkeypatch.setattr(linear, "_probe", lambda _k, candidates, *_, t=times: {c: t[c] for c in candidates})
        linear.batched_products.cache_clear()
        choice = linear.batched_products()
        assert (choice.kernel, choice.long_chunks, choice.panels) == ("onednn", False, faster)
        assert kernels.tile_products() == (True, False, faster == "dpbf16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 64, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, linear.LARGE_ROWS + 1])
def test_make_linear_agrees_with_f_linear_at_every_batch_size(kernels, rows, dtype) -> None:
    """bf16 linears switch from the GEMV to the AMX kernel (where the CPU has it) above GEMV_MAX_ROWS
    rows, to oneDNN (natively, or widened to float32 where oneDNN has no bf16 kernel) above
    AMX_MAX_ROWS, and to oneDNN's second packing above LARGE_ROWS; float32 ones run oneDNN's packed
    product at every row count: every side agrees."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(576, 576, generator=gen).to(dtype)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    out = make_linear(weight)(x)
    assert out.dtype == dtype
    if dtype == torch.bfloat16:
        assert close(out, F.linear(x.float(), weight.float()), dtype)
    else:  # any summation order stays within K units of float32 rounding of the sum of |terms|
        bound = 576 * 2**-24 * F.linear(x.abs().double(), weight.abs().double())
        assert bool(((out.double() - F.linear(x.double(), weight.double())).abs() <= bound).all())


@pytest.mark.skipif(not linear.onednn_packing_works(torch.bfloat16), reason="oneDNN packs no bf16 weights here")
def test_bf16_weights_get_a_second_packing_for_long_prefill_chunks_only_where_asked() -> None:
    weight = torch.randn(64, 64).bfloat16()
    packing = linear._packed_for_rows(weight, torch.bfloat16)
    assert packing(linear.LARGE_ROWS) is packing(1)
    assert packing(linear.LARGE_ROWS + 1) is not packing(linear.LARGE_ROWS)
    lm_head_packing = linear._packed_for_rows(weight, torch.bfloat16, large_rows=False)
    assert lm_head_packing(4 * linear.LARGE_ROWS) is lm_head_packing(1)
    float32_packing = linear._packed_for_rows(weight.float(), torch.float32)
    assert float32_packing(4 * linear.LARGE_ROWS) is float32_packing(1)


@pytest.mark.parametrize("epilogues", [True, False], ids=["oneDNN epilogues", "torch without them"])
@pytest.mark.parametrize("rows", [1, 3, 17, 100, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 2048])
def test_make_gated_up_agrees_with_silu_times_up_at_every_batch_size(kernels, monkeypatch, rows, epilogues) -> None:
    """The GEMV's product then silu_mul (1-2 rows); linear_amx's gated epilogue over the interleaved
    weight (to AMX_MAX_ROWS); above that oneDNN's two products with the silu and the multiplication as
    epilogues; in a torch whose oneDNN lacks them, the product then silu_mul at every row count. Each
    intermediate is rounded to bf16 once, hence two steps of tolerance."""
    monkeypatch.setattr(linear, "_onednn_epilogues_work", lambda dtype: epilogues)
    gen = torch.Generator().manual_seed(8)
    weight = (torch.randn(2 * 1536, 576, generator=gen) / 24).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = linear.make_gated_up(weight, kernels.silu_mul)(x).float()
    assert bool(((got - expected).abs() <= 2**-6 * expected.abs() + 2**-6).all())


def test_a_torch_build_lock_left_by_a_killed_build_is_removed(tmp_path, caplog) -> None:
    lock = tmp_path / "lock"
    lock.touch()  # a build killed a moment ago: its age says nothing, the flock held around the call does
    assert cpu.remove_orphaned_lock(tmp_path)
    assert not lock.exists()
    assert "did not finish" in caplog.text
    assert not cpu.remove_orphaned_lock(tmp_path)  # no lock: nothing to do
