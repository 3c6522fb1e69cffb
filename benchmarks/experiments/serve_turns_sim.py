"""The server's turn rule simulated on the load test's mix: latencies per kind, against solo, and parks.

    python benchmarks/experiments/serve_turns_sim.py [--step 0.034] [--prefill 0.12]

A model of benchmarks/suites/serve_load.py, not a measurement: 8 clients, each sending its 20
requests one after another (kinds in serve_load's rotation: short 16 tokens, long 128, streamed 64,
tools / tools streamed / JSON with a budget of 96 that end after about 30), 4 KV slots, one engine
step at a time costing `--step` seconds (a prompt's first step `--prefill`), 1.7 tokens a step
(`sd` on the embedded pair). Placement as serve_worker._place: the first request in the turn order
that holds a slot or gets one (a free slot, else the last slot holder in the order is parked).
Rules compared: serve_turns.turn_order (now), round-robin (the first version), and "patience"
(a starved request jumps the queue after N steps of others since its own last step; tried before
the deadline rule, and dropped: a long request under short ones gets one step in N + 1).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from viasd_core.frontends.serve_turns import turn_order  # noqa: E402

KINDS = ("short", "long", "stream", "tools", "tools_stream", "json")
BUDGET = {"short": 16, "long": 128, "stream": 64, "tools": 96, "tools_stream": 96, "json": 96}
LENGTH = {"short": 16, "long": 128, "stream": 64, "tools": 30, "tools_stream": 30, "json": 30}
TOKENS_PER_STEP = 1.7


@dataclass(eq=False)
class Job:
    kind: str
    client: int
    arrived: float
    seq: int
    born: int
    budget: int = 0
    binds: bool = True
    tokens: int = 0
    service: float = 0.0
    reason: str | None = None
    waited: int = 0  # steps of others since its last step (the patience rule)
    slot: bool = False
    started: bool = False
    carry: float = 0.0


def patience(n: int):
    def order(jobs):
        late = sorted((j for j in jobs if j.waited >= n), key=lambda j: (-j.waited, j.seq))
        rest = sorted((j for j in jobs if j.waited < n), key=lambda j: (j.budget - j.tokens, j.service, j.seq))
        return late + rest
    return order


def round_robin(jobs):
    return sorted(jobs, key=lambda j: (-j.waited, j.seq))


def simulate(order, step: float, prefill: float, clients: int = 8, requests: int = 20, slots: int = 4):
    """(kind, latency) of every request, the total time, and the parks."""
    plan = [[KINDS[(c + i) % len(KINDS)] for i in range(requests)] for c in range(clients)]
    sent, now, seq, steps, held, parks, live, done = [0] * clients, 0.0, 0, 0, 0, 0, [], []

    def send(c):
        nonlocal seq
        if sent[c] < requests:
            kind = plan[c][sent[c]]
            live.append(Job(kind, c, now, seq, steps, BUDGET[kind]))
            sent[c] += 1
            seq += 1

    for c in range(clients):
        send(c)
    while live:
        ranked = order(live)
        for i, job in enumerate(ranked):
            if job.slot:
                break
            if held < slots:
                job.slot, held = True, held + 1
                break
            victim = next((v for v in reversed(ranked[i + 1:]) if v.slot), None)
            if victim is not None:
                victim.slot, job.slot, parks = False, True, parks + 1
                break
        cost = step if job.started else prefill
        job.started, now, job.service, steps = True, now + cost, job.service + cost, steps + 1
        job.carry += TOKENS_PER_STEP
        job.tokens, job.carry = min(LENGTH[job.kind], job.tokens + int(job.carry)), job.carry % 1
        for j in live:
            j.waited = 0 if j is job else j.waited + 1
        if job.tokens >= LENGTH[job.kind]:
            live.remove(job)
            held -= job.slot
            done.append((job.kind, now - job.arrived))
            send(job.client)
    return done, now, parks


def p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=float, default=0.034, help="seconds an engine step takes")
    ap.add_argument("--prefill", type=float, default=0.12, help="seconds a prompt's first step takes")
    args = ap.parse_args()
    solo = {k: args.prefill + args.step * LENGTH[k] / TOKENS_PER_STEP for k in KINDS}
    print("| rule | short p95 / solo | stream p95 / solo | long p95 / solo | longest answer s | all done s | parks |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, order in [("deadline (serve_turns)", turn_order), ("patience 64", patience(64)),
                        ("patience 16", patience(16)), ("round-robin", round_robin)]:
        done, total, parks = simulate(order, args.step, args.prefill)
        by: dict[str, list[float]] = {}
        for kind, latency in done:
            by.setdefault(kind, []).append(latency)
        ratio = {k: p95(by[k]) / solo[k] for k in ("short", "stream", "long")}
        print(f"| {name} | {ratio['short']:.2f} | {ratio['stream']:.2f} | {ratio['long']:.2f} | "
              f"{max(by['long']):.1f} | {total:.1f} | {parks} |")


if __name__ == "__main__":
    main()
