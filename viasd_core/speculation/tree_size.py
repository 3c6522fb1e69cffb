"""How big a draft tree pays on this device: the cost model behind `--tree auto`.

A speculative step emits `tau` tokens on average (tokens per target pass: the draft's measured
acceptance for that tree or chain) and costs one draft (`draft_seconds`) plus one target pass over
the root and the tree's nodes (`verify_seconds[width]`, measured on this device). The best option
maximises expected tokens per second:

    rate(option) = tau(option) / (draft_seconds(option) + verify_seconds[width(option)])

A plain step is the option with tau 1, no draft and a 1-wide pass. On a GPU the verify curve is
nearly flat up to 16, so the widest tree with the most tau wins; on a CPU, where each extra row
costs, a chain or a small tree does. Pure arithmetic: the measurements come from machine/tree.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from viasd_core.speculation.tree import TreeShape


@dataclass(frozen=True)
class Option:
    """One way to take a step. `shape` None with width 1 is a plain step; a chain of g tokens has
    width g + 1; a tree of `size` nodes has width size + 1."""

    name: str
    shape: TreeShape | None
    width: int
    tau: float  # tokens per target pass, measured
    draft_seconds: float  # one step's drafting, measured

    def seconds(self, verify_seconds: dict[int, float]) -> float:
        return self.draft_seconds + interpolate(verify_seconds, self.width)

    def rate(self, verify_seconds: dict[int, float]) -> float:
        return self.tau / self.seconds(verify_seconds)


def interpolate(curve: dict[int, float], width: int) -> float:
    """The curve's value at `width`: measured, or linear between the nearest measured widths (flat
    past the ends). A pass never costs less for being wider, so a measured width that took longer
    than a wider one counts at the wider one's cost (a busy moment, not the pass: on a 2-core CPU
    a probe once timed 3 tokens at 31 ms and 4 at 26 ms)."""
    curve = {w: min(v for u, v in curve.items() if u >= w) for w in curve}
    if width in curve:
        return curve[width]
    widths = sorted(curve)
    if width <= widths[0]:
        return curve[widths[0]]
    if width >= widths[-1]:
        return curve[widths[-1]]
    hi = next(w for w in widths if w > width)
    lo = max(w for w in widths if w < width)
    return curve[lo] + (curve[hi] - curve[lo]) * (width - lo) / (hi - lo)


def choose(options: list[Option], verify_seconds: dict[int, float]) -> Option:
    """The option of highest expected tokens per second (the first among equals)."""
    if not options or not verify_seconds:
        raise ValueError("choose needs options and a measured verify curve")
    return max(options, key=lambda o: (o.rate(verify_seconds), -options.index(o)))
