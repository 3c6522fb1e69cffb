"""The threshold fit: (theta_accept, theta_slim, theta_confidence) for a fidelity budget.

The recorded blocks of exact sd runs are replayed (router.replay) under every threshold set of a
grid of quantiles of the recorded gates and confidences; the fastest set by modeled throughput
(costs.py) whose replayed fidelity meets the budget with a margin wins. docs/algorithm.md section 5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from viasd_core.calibration.costs import modeled_tokens_per_s, sd_outcome
from viasd_core.speculation.router import OFF, BlockRecord, ReplayOutcome, Thresholds, replay

FIT_MARGIN_Z = 1.0  # the fit's fidelity margin, in standard errors (fidelity_lower_bound)


@dataclass
class Fit:
    thresholds: Thresholds
    outcome: ReplayOutcome
    modeled_tokens_per_s: float
    sd_modeled_tokens_per_s: float


def _quantiles(values: list[float], grid: int) -> list[float]:
    values = sorted(values)
    if not values:
        return []
    return [values[min(len(values) - 1, int(i / grid * (len(values) - 1)))] for i in range(grid + 1)]


def fidelity_lower_bound(outcome: ReplayOutcome, z: float = FIT_MARGIN_Z) -> float | None:
    """The Wilson lower bound, z standard errors below, of the replayed fidelity (None: no token).
    The fit prompts are few; a threshold set that only just meets the budget on them misses it on
    new text about half of the time."""
    n = outcome.tokens
    if not n:
        return None
    f = 1.0 - outcome.wrong / n
    z2 = z * z
    return (f + z2 / (2 * n) - z * math.sqrt(f * (1 - f) / n + z2 / (4 * n * n))) / (1 + z2 / n)


def fit_thresholds(blocks: list[BlockRecord], costs: dict, budget: float, grid: int = 24, confidence_grid: int = 12,
                   z: float = FIT_MARGIN_Z) -> Fit:
    """Grid search over (theta_accept, theta_slim, theta_confidence) maximizing modeled tokens/s
    subject to the replayed fidelity meeting the budget with a margin: its lower bound at z
    standard errors (fidelity_lower_bound) >= 1 - budget. Grid values are quantiles of the
    recorded gates and confidences; a threshold of OFF (> 1) disables its tier, a confidence
    threshold of 0 the condition. Without any recorded token nothing can be shown to meet the
    budget: both tiers stay off (viasd is sd)."""
    values = sorted(set([OFF, 1.0, 0.0] + _quantiles([g for b in blocks for g in b.gate], grid)))
    confidences = sorted(set([0.0] + _quantiles([c for b in blocks for c in b.confidence], confidence_grid)))
    best = None
    for confidence in confidences:
        for accept in values:
            for slim in values:
                if slim > accept:
                    continue
                th = Thresholds(accept, slim, confidence)
                outcome = replay(blocks, th)
                bound = fidelity_lower_bound(outcome, z)
                if bound is None or bound < 1 - budget:
                    continue
                tps = modeled_tokens_per_s(outcome, costs)
                if best is None or tps > best[0]:
                    best = (tps, th, outcome)
    sd = sd_outcome(blocks)
    if best is None or not best[1].active:  # tiers off: viasd is sd (exact, whatever the budget)
        best = (modeled_tokens_per_s(sd, costs), Thresholds(OFF, OFF), sd)
    return Fit(best[1], best[2], best[0], modeled_tokens_per_s(sd, costs))


