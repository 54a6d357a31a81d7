"""Random interleavings of add / step / abort (and n > 1 forks) over a small pool, with and without row
blocks (decode-only steps leaving a sequence out), with and without a sliding window on every layer
(blocks behind it released as sequences advance).

FakeEngine checks after every step that no block leaks, is freed twice or owned twice, that ref counts
equal the block tables holding each block, that every read sees the K/V the reader expects (so a hit
never hands out a block whose contents differ from its hash), that cached blocks' identities match
what was written, and that the token budget and max_num_seqs hold. At the end every request finishes
and the whole pool is free again.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.prefix_cache_fakes import FakeEngine

TOKENS = st.integers(0, 3)  # a tiny vocabulary, so prompts share prefixes often


@dataclass
class Add:
    prefix: int  # index into the scenario's shared prefixes
    suffix: list[int]
    max_tokens: int
    n: int
    salt: str | None


@dataclass
class Abort:
    which: int  # index into the live requests, modulo their number


@dataclass
class Step:
    pass


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_caching: bool
    enable_chunked_prefill: bool
    row_block: int | None  # 2: an odd number (> 2) of one-token rows runs one fewer
    window: int | None  # every layer's window: a query at p reads p - window + 1 .. p
    prefixes: list[list[int]]
    ops: list[Add | Abort | Step]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    max_num_seqs = draw(st.integers(1, 5))
    add = st.builds(
        Add,
        prefix=st.integers(0, 2),
        suffix=st.lists(TOKENS, max_size=5),
        max_tokens=st.integers(1, 6),
        n=st.integers(1, min(3, max_num_seqs)),
        salt=st.sampled_from([None, None, "tenant-a"]),
    )
    # Repeated branches weight the draw: mostly adds and steps, now and then an abort.
    op = st.one_of(st.just(Step()), add, st.just(Step()), add, st.builds(Abort, which=st.integers(0, 7)))
    return Scenario(
        block_size=draw(st.sampled_from([1, 2, 3, 4])),
        num_blocks=draw(st.integers(3, 16)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
        max_num_seqs=max_num_seqs,
        enable_caching=draw(st.booleans() | st.just(True)),
        enable_chunked_prefill=draw(st.booleans() | st.just(True)),
        row_block=draw(st.sampled_from([None, 2])),
        window=draw(st.sampled_from([None, None, 1, 2, 3, 5, 8])),
        prefixes=draw(st.lists(st.lists(TOKENS, min_size=2, max_size=10), min_size=3, max_size=3)),
        ops=draw(st.lists(op, min_size=8, max_size=60)),
    )


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_interleavings_keep_the_pool_consistent(scenario: Scenario) -> None:
    eng = FakeEngine(
        scenario.num_blocks,
        scenario.block_size,
        scenario.max_num_batched_tokens,
        scenario.max_num_seqs,
        scenario.enable_caching,
        scenario.enable_chunked_prefill,
        scenario.row_block,
        scenario.window,
    )
    added = 0
    for op in scenario.ops:
        if isinstance(op, Add):
            # Cut to what InputProcessor.check_lengths accepts: one sample's whole length fits the pool.
            capacity = scenario.num_blocks * scenario.block_size
            max_tokens = min(op.max_tokens, capacity - 1)
            prompt = (scenario.prefixes[op.prefix] + op.suffix)[: capacity - max_tokens]
            eng.add(f"r{added}", prompt, max_tokens, op.n, op.salt)
            added += 1
        elif isinstance(op, Abort) and eng.requests:
            live = sorted(eng.requests)
            eng.abort(live[op.which % len(live)])
        elif isinstance(op, Step):
            eng.step()
        eng.check_invariants()
    eng.run_until_done()
    assert not eng.requests
    assert eng.pool.num_free == eng.pool.num_blocks
    assert all(eng.pool.ref_count(b) == 0 for b in range(eng.pool.num_blocks))
