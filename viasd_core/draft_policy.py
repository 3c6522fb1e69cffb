"""How much to draft: the block length from acceptance, and no drafting when it does not pay.

A speculative step pays only if it emits more tokens per second than a plain step would. Both
rates are measured while generating, on this machine: each step's wall time ends with the step's
one device read, which waits for the device, so the timing needs no extra synchronization. When
plain steps measure faster than speculative ones (a weak draft, a CPU where a multi-token pass is
not free), the policy takes plain steps and tries drafting again every `probe_every` steps, since
the text may turn drafting-friendly (prompt lookup finds repeats, say).

Within speculative steps the block length follows acceptance: one more after a fully accepted
block, one fewer after a block rejected before its middle. Pure bookkeeping: no model, no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftPolicy:
    gamma: int  # the next block length
    gamma_max: int
    adaptive: bool = True  # False: always draft `gamma` tokens (--fixed)
    probe_every: int = 8  # plain steps between two tries of drafting, while drafting does not pay
    smoothing: float = 0.3  # weight of the newest step in the running rates
    spec_rate: float | None = None  # tokens per second of speculative steps (running average)
    plain_rate: float | None = None  # tokens per second of plain steps (running average)
    spec_steps: int = 0
    plain_run: int = 0  # plain steps since the last speculative one

    def block_length(self) -> int:
        """Tokens to draft in the next step; 0 = take a plain step."""
        if not self.adaptive:
            return self.gamma
        if self.plain_rate is None:  # measure a plain step once drafting has been measured
            return 0 if self.spec_steps >= 2 else self.gamma
        if self.spec_rate is not None and self.plain_rate > self.spec_rate and self.plain_run < self.probe_every:
            return 0
        return self.gamma

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def record_plain(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.plain_rate = self._average(self.plain_rate, tokens / seconds)
        self.plain_run += 1

    def record_spec(self, drafted: int, kept: int, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.spec_rate = self._average(self.spec_rate, tokens / seconds)
        self.spec_steps += 1
        self.plain_run = 0
        if self.adaptive and drafted:
            if kept == drafted:
                self.gamma = min(self.gamma + 1, self.gamma_max)
            elif kept < drafted // 2:
                self.gamma = max(self.gamma - 1, 1)
