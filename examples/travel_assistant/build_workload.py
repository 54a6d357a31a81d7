"""The book's travel assistant as a workload (the application layer, §31.1 and §31.7).

Every prompt starts with a policy document, the prefix that caching can reuse, followed by one
user's question. Two documents exist: the current policy (refunds up to 750 yuan) and an archived
one (600 yuan). They differ from their first line on, so no cache block after the chat template's
shared header can match across them: an answer about current tickets can never be computed from
the archived rule. Each tenant (travel agency) sends its own users' questions with its own
cache_salt, so cached state is reused within a tenant and never across tenants.

Each request carries its evaluation contract: a current-policy answer must state 750 and not 600;
an archived-policy answer must state 600 and not 750.

    python examples/travel_assistant/build_workload.py --out travel.jsonl
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from kvserve.bench import workload
from kvserve.bench.generators import arrival_times_ms
from kvserve.bench.workload import WorkloadRequest

_RULES = """2. Cancel at least 24 hours before departure: the fare is refunded in full, up to the limit.
3. Cancel less than 24 hours before departure: half of the fare is refunded, up to the limit.
4. No refund is given after departure, except when the journey was cancelled by the operator.
5. Refunds go back to the original payment method within 7 working days.
6. Changing the travel date is free once per ticket; a second change counts as a cancellation.
7. Group bookings of ten or more passengers follow the same limit for each ticket.
8. Keep the booking reference: the agent needs it to find the ticket and process the refund."""

CURRENT_POLICY = f"""TRAVEL REFUND POLICY, CURRENT VERSION (effective 1 March 2024).
1. Refund limit: a cancelled ticket is refunded up to 750 yuan per ticket.
{_RULES}"""

ARCHIVED_POLICY = f"""ARCHIVED REFUND RULES (superseded on 1 March 2024; only for tickets bought before it).
1. Refund limit: a cancelled ticket is refunded up to 600 yuan per ticket.
{_RULES}"""

CURRENT_QUESTIONS = (
    "What is the most I can get refunded for one cancelled ticket?",
    "I cancel my train ticket two days before departure. What is the maximum refund in yuan?",
    "What refund limit per ticket applies to my booking made this week?",
    "My family has four tickets. What is the refund limit for each ticket?",
)
ARCHIVED_QUESTIONS = (
    "My ticket was bought in 2023, under the archived rules. What was the refund limit per ticket?",
    "Under the old superseded rules, what is the most a cancelled ticket is refunded?",
)

# "States X and not Y", anywhere in the answer: a regex with a negative lookahead over all of it.
ACCEPT_CURRENT = {"regex": r"(?s)^(?!.*\b600\b).*\b750\b"}
ACCEPT_ARCHIVED = {"regex": r"(?s)^(?!.*\b750\b).*\b600\b"}


def prompt(document: str, question: str) -> str:
    """Document first, so it is the shared prefix; the user's question last."""
    return f"{document}\n\nAnswer from the policy above. {question}"


def build(
    tenants: int = 3, users_per_tenant: int = 4, rate: float = 4.0, max_tokens: int = 32, seed: int = 0
) -> list[WorkloadRequest]:
    """Each user asks one question: every ``users_per_tenant``-th user asks about an archived
    ticket, the rest about current ones. Arrivals are Poisson at ``rate`` requests/s."""
    rng = random.Random(seed)
    users = [(t, u) for t in range(tenants) for u in range(users_per_tenant)]
    rng.shuffle(users)
    requests = []
    for (tenant, user), arrival in zip(users, arrival_times_ms(len(users), rate, seed=seed), strict=True):
        archived = user % 4 == 3
        questions = ARCHIVED_QUESTIONS if archived else CURRENT_QUESTIONS
        requests.append(
            WorkloadRequest(
                id=f"agency{tenant}-user{user}-{'archived' if archived else 'current'}",
                arrival_ms=round(arrival, 3),
                prompt=prompt(ARCHIVED_POLICY if archived else CURRENT_POLICY, rng.choice(questions)),
                max_tokens=max_tokens,
                tenant=f"agency{tenant}",
                cache_salt=f"agency{tenant}",
                accept=ACCEPT_ARCHIVED if archived else ACCEPT_CURRENT,
            )
        )
    return requests


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's shape, shared by this script and compare_prefix_caching.py."""
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--users-per-tenant", type=int, default=4)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    requests = build(args.tenants, args.users_per_tenant, args.rate, args.max_tokens, args.seed)
    workload.save(requests, args.out)
    print(f"wrote {len(requests)} requests to {args.out}")


if __name__ == "__main__":
    main()
