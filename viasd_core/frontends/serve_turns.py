"""Whose turn it is on the engine: the rule the server's requests take engine steps by (a pure function).

Every request the server has taken (started or not, on a slot or parked) is a candidate for the
next engine step. The order:

1. stopped first: a request whose client left, whose time ran out or that the shutdown ends takes
   its one last step (Engine.steps ends it there) before anything else;
2. overdue next: a request that has waited PATIENCE engine steps of others since its last step
   (or since it arrived) goes before the rest, the longest waiting first. This bounds starvation:
   a request waits at most PATIENCE steps plus one step of each other overdue request (while a
   slot can be had for it; see serve_worker);
3. then the smallest remaining budget: `max_tokens` (cut to what the context leaves) minus the
   tokens it produced. An answer can never be longer than its budget, so a request with a smaller
   one is sure to need fewer steps: a short request runs before a long one, even when they arrive
   together (shortest remaining bound first);
4. on equal budgets, the least attained service: the request that has had the fewest seconds on
   the engine (a newcomer first), so requests without `max_tokens` (all with the context's
   budget) share the engine, the newest first, without knowing their sizes;
5. then arrival order.

Why not plain round-robin: with 8 clients on 4 slots a short request waited for a slot behind long
ones and then shared every step with three others (docs/serve.md, "Under load"). Why not the least
attained service alone: requests arriving together all have none, so a short one among them would
share the engine with all of them (8 at once: about 8 times its solo time).
"""

from __future__ import annotations

from typing import Protocol

PATIENCE = 64  # engine steps of others a request may wait before it goes first


class Turn(Protocol):
    reason: str | None  # set: stopped (abort, timeout, shutdown)
    budget: int  # most new tokens it may produce
    tokens: int  # new tokens so far
    service: float  # seconds on the engine so far
    waited: int  # engine steps of others since its last step (or its arrival)
    seq: int  # arrival order


def priority(job: Turn) -> tuple:
    """Rules 3-5: the smaller, the sooner."""
    return job.budget - job.tokens, job.service, job.seq


def turn_order(jobs: list[Turn], patience: int = PATIENCE) -> list[Turn]:
    """`jobs` in the order they may take the next engine step (the first that can get a slot runs)."""
    stopped = [j for j in jobs if j.reason is not None]
    overdue = [j for j in jobs if j.reason is None and j.waited >= patience]
    rest = [j for j in jobs if j.reason is None and j.waited < patience]
    return (sorted(stopped, key=lambda j: j.seq) + sorted(overdue, key=lambda j: (-j.waited, j.seq))
            + sorted(rest, key=priority))


def took_turn(jobs: list[Turn], ran: Turn) -> None:
    """Count one engine step of `ran`: every other job has waited one more."""
    for j in jobs:
        j.waited = 0 if j is ran else j.waited + 1
