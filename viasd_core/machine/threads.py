"""`--threads auto|N`: how many CPU threads a session's passes use, measured on this machine now.

torch starts with one thread per core. That is right on an idle machine and badly wrong on a busy
one: with another job holding one of two cores (even at nice 19), a 2-thread pass waits at every
parallel region for the thread that lost its core, and decoding fell from 57 to 0.8 tokens/s,
while 1 thread gave 34.5 (docs/experiments/threads-under-load.md; not seen again since, but a same-priority
busy loop still makes 2 threads 3.1x slower than 1). How busy a machine is changes from run to
run, so `auto` is not cached: each session times a short and a verify-sized target pass at a few
thread counts (1, 2, 4, ... and every usable core) before anything else is measured or compiled, and
keeps the fastest; a count within `TIE` of the fastest wins when it uses fewer threads (it leaves
the cores to other work for the same speed). On a GPU the count is left as torch set it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from viasd_core.devices import usable_cores
from viasd_core.errors import UsageError
from viasd_core.machine.record import Decision

THREAD_CHOICES = "auto or a thread count (1 or more)"
TIE = 0.05  # fewer threads win within 5% of the fastest
REPEATS = 3
BUSY_SLOWER = 1.25


def parse_threads(text: str | int | None) -> str | int:
    """'auto' | N >= 1 from the option's text."""
    value = str(text if text is not None else "auto").strip().lower()
    if value == "auto":
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise UsageError(f"--threads must be {THREAD_CHOICES} (got '{text}')")


def candidates(cores: int) -> list[int]:
    """1, 2, 4, ... below `cores`, and `cores` itself."""
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return out + [cores]


@dataclass
class ThreadChoice:
    """What `--threads` resolved to and why (shown by doctor, recorded in the bench's meta)."""

    threads: int
    reason: str
    seconds: dict[int, float] = field(default_factory=dict)  # threads -> measured seconds (auto only)

    @property
    def busy(self) -> bool:
        """auto measured the most threads it tried BUSY_SLOWER times slower than the count it chose:
        other work holds cores (said to the user; a near-tie is not)."""
        return bool(self.seconds) and self.seconds[max(self.seconds)] > BUSY_SLOWER * self.seconds[self.threads]

    def to_dict(self) -> dict:
        return {"threads": self.threads, "reason": self.reason, "seconds": {str(k): v for k, v in self.seconds.items()}}


def pick(seconds: dict[int, float], tie: float = TIE) -> int:
    """The fewest threads whose time is within `tie` of the fastest measured."""
    best = min(seconds.values())
    return min(n for n, s in seconds.items() if s <= best * (1 + tie))


def measure(step: Callable[[int], float], counts: list[int], repeats: int = REPEATS) -> dict[int, float]:
    """The seconds `step(repeats)` reports at each thread count, after an unmeasured `step(1)`."""
    seconds = {}
    for n in counts:
        torch.set_num_threads(n)
        step(1)
        seconds[n] = step(repeats)
    return seconds


DECISION = Decision("threads", "--threads auto", None, measure,  # not stored: a machine's load changes between runs
                    "the fewest CPU threads within 5% of the fastest 1- plus 4-token target pass, timed every session")


def resolve_threads(choice: str | int, device: torch.device, step: Callable[[int], float]) -> ThreadChoice:
    """Set torch's thread count for `choice` and say why. `step(repeats)` times representative
    passes and returns their (median) seconds (`auto` on a CPU measures it)."""
    choice = parse_threads(choice)
    if isinstance(choice, int):
        torch.set_num_threads(choice)
        return ThreadChoice(choice, f"--threads {choice}")
    if device.type == "cuda":
        return ThreadChoice(torch.get_num_threads(), "auto: a GPU runs the passes (torch's default for the rest)")
    counts = candidates(usable_cores())
    if len(counts) == 1:
        torch.set_num_threads(1)
        return ThreadChoice(1, "auto: one usable core")
    seconds = measure(step, counts)
    n = pick(seconds)
    torch.set_num_threads(n)
    timed = ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in seconds.items())
    return ThreadChoice(n, f"auto: fastest of the counts measured now ({timed} for a 1- and a 4-token pass)", seconds)
