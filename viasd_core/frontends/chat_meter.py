"""The chat's live status line while an answer is generated: running counts of one answer."""

from __future__ import annotations

import time

from viasd_core.speculation.stats import TIERS
from viasd_core.speculation.steps import StepResult


class LiveMeter:
    """Running statistics of the answer being generated, from the engine's on_emit calls and,
    installed as an engine observer, its step results.

    One on_emit call is one engine step; a step cost a target pass when it holds an
    ar / full / bonus token (viasd skips the target when the slim verifier decides all).
    The exact numbers come from RunStats when the answer ends.
    """

    def __init__(self, mode: str, budget: float | None = None):
        self.mode = mode
        self.budget = budget
        self.start = time.perf_counter()
        self.tokens = 0
        self.passes = 0
        self.drafted = 0
        self.kept = 0
        self.tier_counts = {t: 0 for t in TIERS}

    def on_emit(self, tokens: list[int], tiers: list[str]) -> None:
        self.tokens += len(tokens)
        for t in tiers:
            if t in self.tier_counts:
                self.tier_counts[t] += 1
        if any(t in ("ar", "full", "bonus") for t in tiers):
            self.passes += 1

    def on_step(self, engine, step: StepResult) -> None:
        """An engine observer: the step's drafted and accepted counts (already on the host)."""
        self.drafted += step.drafted
        self.kept += step.kept

    def fields(self) -> list[tuple[str, str]]:
        """(value, label) pairs for a status line."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = [(self.mode, ""), (str(self.tokens), "tok"), (f"{self.tokens / elapsed:.1f}", "tok/s")]
        if self.mode != "ar":
            total = sum(self.tier_counts.values()) or 1
            out.append((f"{self.tokens / self.passes:.2f}" if self.passes else "-", "tok/pass"))
            out.append((f"{self.kept / self.drafted:.2f}" if self.drafted else "-", "accepted"))
            out.append((" ".join(f"{t[0].upper()}{100 * self.tier_counts[t] / total:.0f}" for t in TIERS), "% tiers"))
        out.append((f"{self.passes / self.tokens:.2f}" if self.tokens else "-", "passes/tok"))
        if self.mode == "viasd" and self.budget is not None:
            out.append((f">= {1 - self.budget:.3f}", "fidelity budget"))
        return out
