"""How much to draft: the block length with the most expected tokens per second, from what this
machine's steps measured.

A step asked to draft g tokens emits, in expectation,

    E(g) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_g

tokens, a_i being the chance that token i is proposed and accepted once tokens 1..i-1 were (the 1
is the target's own token after the block; a draft may stop early, by its confidence stop or for
want of a proposal, and that counts as a rejection), and costs C(g) seconds: the draft's
proposals plus a target pass over up to g + 1 positions (C(0) is a plain step). The policy drafts the g in 0..gamma_max
with the largest E(g) / C(g), as speculative decoding's expected-speedup rule does (Leviathan et
al., 2023, section 3.5). Both factors are measured while generating, on this machine:

- a_i: decayed counts of the steps whose token i was due (asked for i or more, tokens 1..i-1
  accepted) and of those whose token i was proposed and accepted.
  A depth never reached takes the rate of the one before it (its prior); depth 1's prior is 1/2.
- C(g): the decayed mean wall time of the steps asked to draft g tokens. Each step's wall time ends
  with the step's one device read, which waits for the device, so the timing needs no extra
  synchronization. A g not run yet is priced on the line through its measured neighbours (the
  slope of the two widest measured beyond them): this machine's verify-cost curve, draft included,
  as the steps trace it. Where a wide pass costs little (a GPU) blocks grow; where it does not (a
  CPU, a weak draft) they shrink, down to plain steps.

The first two steps draft `gamma` tokens and the third is plain, so that both kinds are measured
before any choice. While plain steps win, drafting is tried again every `probe_every` plain steps
(at the best g >= 1), since acceptance changes with the text (prompt lookup finds repeats, say)
and a plain step measures none. Pure bookkeeping: no model, no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_PRIOR = 0.5  # depth 1's acceptance before any block was verified
PRIOR_WEIGHT = 1.0  # how many blocks the prior counts for


@dataclass
class DraftPolicy:
    gamma: int  # the first block length; with adaptive=False, every block's
    gamma_max: int
    adaptive: bool = True  # False: always draft `gamma` tokens (--fixed)
    probe_every: int = 4  # plain steps between two tries of drafting, while drafting does not pay
    decay: float = 0.8  # weight of the past in the running sums, per step of the same kind
    reached: list[float] = field(default_factory=list)  # [i]: decayed steps whose token i + 1 was due
    accepted: list[float] = field(default_factory=list)  # [i]: ... and proposed and accepted
    seconds: dict[int, float] = field(default_factory=dict)  # g -> decayed sum of step seconds
    steps: dict[int, float] = field(default_factory=dict)  # g -> decayed count of steps
    spec_steps: int = 0
    plain_run: int = 0  # plain steps since the last speculative one

    # ------------------------------------------------------------------ the estimates
    def acceptance(self) -> list[float]:
        """a_1 .. a_gamma_max: measured rates, shrunk toward the depth before (FIRST_PRIOR for depth 1)."""
        rates, prior = [], FIRST_PRIOR
        for i in range(self.gamma_max):
            reached = self.reached[i] if i < len(self.reached) else 0.0
            accepted = self.accepted[i] if i < len(self.accepted) else 0.0
            prior = (accepted + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)
            rates.append(prior)
        return rates

    def expected_tokens(self, g: int) -> float:
        """E(g): tokens a step asked to draft g emits in expectation (1 for a plain step)."""
        total, run = 1.0, 1.0
        for a in self.acceptance()[:g]:
            run *= a
            total += run
        return total

    def cost(self, g: int) -> float | None:
        """C(g): measured mean seconds of a step drafting g tokens, or priced on the line through the
        measured ones (None before two widths were measured)."""
        if self.steps.get(g):
            return self.seconds[g] / self.steps[g]
        known = sorted(w for w, n in self.steps.items() if n)
        if len(known) < 2:
            return None
        mean = {w: self.seconds[w] / self.steps[w] for w in known}
        below = [w for w in known if w < g]
        above = [w for w in known if w > g]
        if below and above:  # between two measured widths: on the line through them
            lo, hi = below[-1], above[0]
            return mean[lo] + (mean[hi] - mean[lo]) * (g - lo) / (hi - lo)
        lo, hi = (known[-2], known[-1]) if below else (known[0], known[1])
        slope = max((mean[hi] - mean[lo]) / (hi - lo), 0.0)  # beyond the measured, a longer block never costs less
        anchor = hi if below else lo
        return max(mean[anchor] + slope * (g - anchor), 1e-9)

    def rate(self, g: int) -> float | None:
        cost = self.cost(g)
        return None if cost is None else self.expected_tokens(g) / cost

    # ------------------------------------------------------------------ the choice
    def block_length(self) -> int:
        """Tokens to draft in the next step; 0 = take a plain step."""
        if not self.adaptive:
            return self.gamma
        if self.spec_steps < 2:
            return self.gamma
        if not self.steps.get(0):
            return 0  # measure a plain step once drafting has been measured
        rates = {g: r for g in range(self.gamma_max + 1) if (r := self.rate(g)) is not None}
        best = max(rates, key=lambda g: (rates[g], -g))
        if best == 0 and self.plain_run >= self.probe_every:  # probe: the best block, or the first length
            drafted = [g for g in rates if g > 0]
            best = max(drafted, key=lambda g: (rates[g], -g)) if drafted else self.gamma
        return best

    # ------------------------------------------------------------------ what the steps measured
    def _time(self, g: int, seconds: float) -> None:
        self.seconds[g] = self.decay * self.seconds.get(g, 0.0) + max(seconds, 0.0)
        self.steps[g] = self.decay * self.steps.get(g, 0.0) + 1.0

    def record_plain(self, seconds: float) -> None:
        self._time(0, seconds)
        self.plain_run += 1

    def record_spec(self, asked: int, kept: int, seconds: float) -> None:
        """A speculative step asked to draft `asked` tokens, of which the first `kept` were proposed
        and accepted, in `seconds`. A draft that stopped early or proposed nothing counts as a
        rejection at the first token it did not propose: a_i is the chance that a step asked for at
        least i tokens gets token i proposed and accepted, given tokens 1..i-1 were."""
        self._time(asked, seconds)
        self.spec_steps += 1
        self.plain_run = 0
        if not self.adaptive:
            return
        grow = asked - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for i in range(min(asked, kept + 1)):  # token i + 1 was due: tokens 1..i were accepted
            self.reached[i] = self.decay * self.reached[i] + 1.0
            self.accepted[i] = self.decay * self.accepted[i] + (1.0 if i < kept else 0.0)
