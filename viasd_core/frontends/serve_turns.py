"""Whose turn it is on the engine: the rule the server's requests take engine steps by (a pure function).

Every request the server has taken (started or not, on a slot or parked) is a candidate for the
next engine step. The order:

1. stopped first: a request whose client left, whose time ran out or that the shutdown ends takes
   its one last step (Engine.steps ends it there) before anything else;
2. then the earliest deadline, where a request's deadline is the engine step it was taken at plus
   what it still expects to need, in steps: `born + expected / AGING`, that is the key
   `expected + AGING * born`. `expected` is the budget it has left where its `max_tokens` binds
   (`max_tokens` minus the tokens it produced: an answer can never be longer, so a request that
   asks for fewer tokens is sure to need fewer steps and goes first: shortest remaining bound
   first); for a request without a binding budget (no `max_tokens`: the context's end) it is the
   tokens it produced plus GRACE (least attained service: a newcomer goes first, and such requests
   share the engine in turns, none knowing its size);
3. then the least time on the engine, then arrival.

The AGING term bounds waiting: a request taken `d` steps after another is ahead of it only while
its expected need is `AGING * d` tokens below the other's, so any request goes first once it has
waited `expected / AGING` steps, whatever keeps arriving (tested).

Why not plain round-robin: with 8 clients on 4 slots a short request waited for a slot behind long
ones and then shared every step with three others (16x its solo latency at p95). Why not a
"patience" rule that lets a starved request jump the queue once every N steps: such a request gets
one step in N + 1, so a long answer under a stream of short ones took N times its solo time (it
timed out under the 8-client load) and every such turn parked a slot holder. Simulated on the load
test's mix (8 clients, 4 slots, short/long/streamed/tools/JSON;
benchmarks/experiments/serve_turns_sim.py), this rule kept short requests at about their solo
latency and the longest answer at 30 s against 50 s, with no parking at all; streamed answers of 64
tokens waited more (p95 5.3x solo against 1.2x) (docs/serve.md, "Turns").
"""

from __future__ import annotations

from typing import Protocol

AGING = 0.1  # budget tokens a waiting request gains on newer ones per engine step (1 per 10 steps)
GRACE = 16  # a request without a binding budget expects this many more tokens than it produced


class Turn(Protocol):
    reason: str | None  # set: stopped (abort, timeout, shutdown)
    budget: int  # most new tokens it may produce
    binds: bool  # whether `budget` came from its max_tokens (False: only the context's end bounds it)
    tokens: int  # new tokens so far
    service: float  # seconds on the engine so far
    born: int  # the engine step it was taken at
    seq: int  # arrival order


def expected(job: Turn) -> int:
    """The tokens `job` still expects to need (rule 2)."""
    return job.budget - job.tokens if job.binds else job.tokens + GRACE


def priority(job: Turn) -> tuple:
    """Rules 2-3: the smaller, the sooner."""
    return expected(job) + AGING * job.born, job.service, job.seq


def turn_order(jobs: list[Turn]) -> list[Turn]:
    """`jobs` in the order they may take the next engine step (the first that can get a slot runs)."""
    stopped = [j for j in jobs if j.reason is not None]
    return sorted(stopped, key=lambda j: j.seq) + sorted((j for j in jobs if j.reason is None), key=priority)
