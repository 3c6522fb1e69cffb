"""How much to draft: the block length from acceptance, and no drafting when it does not pay.

A speculative step pays only if it emits more tokens per second than a plain step would. Both
rates are measured while generating, on this machine: each step's wall time ends with the step's
one device read, which waits for the device, so the timing needs no extra synchronization. When
plain steps measure faster than speculative ones (a weak draft, a CPU where a multi-token pass is
not free), the policy takes plain steps and tries drafting again every `probe_every` steps, since
the text may turn drafting-friendly (prompt lookup finds repeats, say).

Within speculative steps the block length follows acceptance: one more after a fully accepted
block, one fewer after a block rejected before its middle. Where this device's verify curve was
measured (seconds of a target pass over w tokens: tree_choice.verify_curve), the block never grows
past the length of most expected tokens per second on that curve at the acceptance measured while
generating:

    cap = argmax over g of  (1 + p0 + p0 p1 + ... + p0 ... p(g-1)) / (verify(g + 1) + g * draft)

where p_j is the running chance that draft j is kept given the drafts before it were, and `draft`
the measured drafting seconds a token. So on a CPU whose int4 kernel takes rows four at a time, a
block stops before the fifth row unless the drafts are right often enough to pay for it, while on a
GPU, where the curve is nearly flat, the block grows as acceptance allows. Pure bookkeeping: no
model, no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from viasd_core.decoding.tree_size import interpolate


@dataclass
class DraftPolicy:
    gamma: int  # the next block length
    gamma_max: int
    adaptive: bool = True  # False: always draft `gamma` tokens (--fixed)
    probe_every: int = 4  # plain steps between two tries of drafting, while drafting does not pay
    decay: float = 0.8  # weight of the past in the running sums, per step of the same kind
    spec_tokens: float = 0.0  # decayed sums of tokens and seconds, per kind of step
    spec_seconds: float = 0.0
    plain_tokens: float = 0.0
    plain_seconds: float = 0.0
    spec_steps: int = 0
    plain_run: int = 0  # plain steps since the last speculative one
    verify_seconds: dict[int, float] | None = None  # this device's verify curve (None: no cap from it)
    attempted: list[float] = field(default_factory=list)  # decayed blocks that tried draft j, all before it kept
    accepted: list[float] = field(default_factory=list)  # ... and kept it
    draft_tokens: float = 0.0  # decayed drafted tokens and their drafting seconds
    draft_seconds: float = 0.0

    @property
    def spec_rate(self) -> float | None:
        """Tokens per second of speculative steps (decayed sums, so a block of 6 weighs 6 tokens)."""
        return self.spec_tokens / self.spec_seconds if self.spec_seconds > 0 else None

    @property
    def plain_rate(self) -> float | None:
        return self.plain_tokens / self.plain_seconds if self.plain_seconds > 0 else None

    def block_length(self) -> int:
        """Tokens to draft in the next step; 0 = take a plain step."""
        if not self.adaptive:
            return self.gamma
        spec, plain = self.spec_rate, self.plain_rate
        if plain is None and self.spec_steps >= 2:  # measure a plain step once drafting has been measured
            return 0
        if plain is not None and spec is not None and plain > spec and self.plain_run < self.probe_every:
            return 0
        return self.gamma if self.verify_seconds is None else min(self.gamma, self.cap())

    def __post_init__(self) -> None:
        if not self.verify_seconds:
            self.verify_seconds = None
        # the pass of g drafts covers g + 1 tokens: its cost per g, read once
        self._verify = (None if self.verify_seconds is None else
                        [interpolate(self.verify_seconds, g + 1) for g in range(self.gamma_max + 1)])

    def acceptance(self) -> list[float]:
        """p_j for j < gamma_max: the measured chance that draft j is kept given the drafts before it
        were (decayed counts, a prior of half a kept draft in one try); past the last position tried
        at least once (decayed), that position's."""
        out, last = [], 0.5
        for j in range(self.gamma_max):
            if j < len(self.attempted) and self.attempted[j] >= 0.5:
                last = (self.accepted[j] + 0.5) / (self.attempted[j] + 1.0)
            out.append(last)
        return out

    def cap(self) -> int:
        """The block length 1..gamma_max of most expected tokens per second on the verify curve."""
        per_draft = self.draft_seconds / self.draft_tokens if self.draft_tokens > 0 else 0.0
        best, best_rate, expected, reach = 1, -1.0, 1.0, 1.0
        for g, p in enumerate(self.acceptance(), start=1):
            reach *= p
            expected += reach
            rate = expected / (self._verify[g] + g * per_draft)
            if rate > best_rate:
                best, best_rate = g, rate
        return best

    def record_plain(self, tokens: int, seconds: float) -> None:
        self.plain_tokens = self.decay * self.plain_tokens + tokens
        self.plain_seconds = self.decay * self.plain_seconds + max(seconds, 0.0)
        self.plain_run += 1

    def record_spec(self, drafted: int, kept: int, tokens: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """A speculative step: `drafted` proposals, the first `kept` of them kept, `tokens` emitted in
        `seconds` of wall time, `draft_seconds` of which drafting took."""
        if self.verify_seconds is not None and drafted:
            tried = min(kept + 1, drafted)  # drafts compared: the kept ones and the first rejected one
            grow = max(tried - len(self.attempted), 0)
            self.attempted = [self.decay * a for a in self.attempted] + [0.0] * grow
            self.accepted = [self.decay * a for a in self.accepted] + [0.0] * grow
            for j in range(tried):
                self.attempted[j] += 1
                self.accepted[j] += j < kept
            self.draft_tokens = self.decay * self.draft_tokens + drafted
            self.draft_seconds = self.decay * self.draft_seconds + max(draft_seconds, 0.0)
        self.spec_tokens = self.decay * self.spec_tokens + tokens
        self.spec_seconds = self.decay * self.spec_seconds + max(seconds, 0.0)
        self.spec_steps += 1
        self.plain_run = 0
        if self.adaptive and drafted:
            if kept == drafted:  # under a cap: one more than the block drafted, so gamma stays near the cap
                self.gamma = min((self.gamma if self.verify_seconds is None else drafted) + 1, self.gamma_max)
            elif kept < drafted // 2:
                self.gamma = max(self.gamma - 1, 1)
