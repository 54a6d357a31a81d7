"""Workload generators, all deterministic given their seed.

Arrivals: gaps drawn from a gamma distribution with mean 1/rate and coefficient of variation
``cv`` (shape 1/cv^2): cv=1 is a Poisson process, cv>1 is burstier, cv<1 more regular; rate=inf
sends everything at once. The first request arrives at 0 ms (arrivals are offsets from it).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvserve.bench.workload import WorkloadRequest

_WORDS = (
    "ticket fare refund train station platform journey passenger booking seat carriage route "
    "schedule delay luggage window aisle return single open date change cancel fee policy rule "
    "counter receipt online agent travel day night morning evening express regional ferry bus "
    "airport hotel transfer voucher member card discount child senior student group annual"
).split()


def arrival_times_ms(n: int, rate: float, cv: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` arrival offsets in ms for ``rate`` requests/s with inter-arrival CV ``cv``."""
    if n < 0 or not rate > 0 or not cv > 0:
        raise ValueError(f"need n >= 0, rate > 0, cv > 0 (got n={n}, rate={rate}, cv={cv})")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    shape = 1.0 / cv**2
    scale_ms = 1000.0 / (rate * shape)  # mean gap = shape * scale = 1000 / rate
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(shape, scale_ms)
    return times


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``N`` (fixed), ``uniform:LO:HI`` or ``normal:MEAN:STD``
    (normal samples are rounded and clipped to >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        parts = str(spec).split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", int(parts[0]))
            elif parts[0] in ("uniform", "normal") and len(parts) == 3:
                dist = cls(parts[0], float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length {spec!r}: use N, uniform:LO:HI or normal:MEAN:STD") from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or dist.b < 0:
            raise ValueError(f"bad length {spec!r}: lengths must be >= 1 and ranges ordered")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))


def passage(rng: random.Random, num_words: int) -> str:
    """Deterministic pseudo-text: sentences of travel words, so prompts tokenize like prose."""
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    sentences = [" ".join(words[i : i + 12]) for i in range(0, num_words, 12)]
    return ". ".join(s.capitalize() for s in sentences) + "."


def random_workload(
    n: int, rate: float, input_len: LengthDist, output_len: LengthDist, cv: float = 1.0, seed: int = 0
) -> list[WorkloadRequest]:
    """Fixed-length token-id requests (ids generated at replay), every output run to max_tokens."""
    rng = random.Random(seed)
    arrivals = arrival_times_ms(n, rate, cv, seed)
    return [
        WorkloadRequest(
            id=f"r{i}",
            arrival_ms=round(t, 3),
            input_len=input_len.sample(rng),
            max_tokens=output_len.sample(rng),
            ignore_eos=True,
        )
        for i, t in enumerate(arrivals)
    ]


def shared_prefix_workload(
    num_docs: int,
    questions_per_doc: int,
    rate: float,
    output_len: LengthDist,
    num_tenants: int = 1,
    doc_words: int = 300,
    cv: float = 1.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """``num_docs`` documents, each asked ``questions_per_doc`` questions; the document is the
    shared prefix. Requests are spread round-robin over tenants, each with its own cache_salt,
    so the same document is cached once per tenant, never across tenants."""
    rng = random.Random(seed)
    docs = [f"Document {d}.\n{passage(rng, doc_words)}" for d in range(num_docs)]
    pairs = [(d, q) for d in range(num_docs) for q in range(questions_per_doc)]
    rng.shuffle(pairs)
    arrivals = arrival_times_ms(len(pairs), rate, cv, seed)
    requests = []
    for i, ((d, q), t) in enumerate(zip(pairs, arrivals, strict=True)):
        tenant = f"tenant{i % num_tenants}"
        question = f"Question {q}: what does the document say about {rng.choice(_WORDS)}?"
        requests.append(
            WorkloadRequest(
                id=f"d{d}q{q}",
                arrival_ms=round(t, 3),
                prompt=f"{docs[d]}\n\n{question}\nAnswer:",
                max_tokens=output_len.sample(rng),
                tenant=tenant,
                cache_salt=tenant,
            )
        )
    return requests


def copy_workload(
    n: int, rate: float, passage_words: int = 60, cv: float = 1.0, seed: int = 0
) -> list[WorkloadRequest]:
    """Requests whose answer mostly copies the prompt ("repeat" or "edit this passage"), the case
    prompt-lookup speculation is built for. max_tokens leaves room for the whole passage
    (about 1.5 tokens a word here). ``accept``: a repeat must give back the passage's opening
    words; an edit (of a word the passage contains) must contain the replacement word."""
    rng = random.Random(seed)
    arrivals = arrival_times_ms(n, rate, cv, seed)
    requests = []
    for i, t in enumerate(arrivals):
        text = passage(rng, passage_words)
        if i % 2 == 0:
            instruction = "Repeat the following passage exactly."
            accept = {"contains": " ".join(text.split()[:4])}
        else:
            old = rng.choice(text.lower().replace(".", "").split())
            new = rng.choice([w for w in _WORDS if w != old])
            instruction = f"Rewrite the following passage, replacing every '{old}' with '{new}'."
            accept = {"contains": new}
        requests.append(
            WorkloadRequest(
                id=f"c{i}",
                arrival_ms=round(t, 3),
                prompt=f"{instruction}\n\n{text}\n\nAnswer:",
                max_tokens=math.ceil(passage_words * 1.5) + 8,
                accept=accept,
            )
        )
    return requests
