"""How much to draft: the block length from acceptance, and no drafting when it does not pay.

A speculative step pays only if it emits more tokens per second than a plain step would. Both
rates are measured while generating, on this machine: each step's wall time ends with the step's
one device read, which waits for the device, so the timing needs no extra synchronization. When
plain steps measure faster than speculative ones (a weak draft, a CPU where a multi-token pass is
not free), the policy takes plain steps and tries drafting again every `probe_every` steps, since
the text may turn drafting-friendly (prompt lookup finds repeats, say).

Within speculative steps the block length follows acceptance. Where this machine's costs were
measured (`BlockCosts`: the verify pass at each width and a drafted token's cost, from `--tree
auto`'s probe), the block is the length of most expected tokens per second, from those costs and
the acceptance at each block position measured while generating (the probe's acceptance is the
starting point):

    rate(g) = (1 + sum_{i<=g} prod_{j<=i} a_j) / (g * draft_seconds + verify_seconds[g + 1])

with a_j the share of drafted tokens at position j accepted when position j was reached. Every
4th speculative block drafts one token more than that length, so the position past it is measured
too (a probe on two prompts can misjudge it badly: a lookup draft's second token is accepted far
more often on repetitive text than on the probe's). Without
measured costs it is a step rule: one more after a fully accepted block, one fewer after a block
rejected before its middle. Pure bookkeeping: no model, no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from viasd_core.decoding.tree_size import interpolate

PRIOR_WEIGHT = 4.0  # the probe's acceptance counts as this many blocks at each position


@dataclass(frozen=True)
class BlockCosts:
    """What a block of g drafted tokens costs on this device, measured: `verify_seconds` {width:
    seconds} of a target pass over w tokens (interpolated between measured widths), and
    `draft_seconds` a drafted token. `prior` is the probe's acceptance: the share of blocks whose
    tokens 1..i were all accepted, for i = 1, 2, ... (tokens per pass = 1 + sum(prior))."""

    verify_seconds: dict[int, float]
    draft_seconds: float
    prior: tuple[float, ...]

    def __post_init__(self):
        if not self.verify_seconds or not self.prior:
            raise ValueError("BlockCosts needs a measured verify curve and the probe's acceptance")


def expected_tokens(acceptance: list[float], g: int) -> float:
    """Tokens a block of g drafted tokens emits on average (the verify pass's own token included),
    given the acceptance a_j at each position j = 1..g when reached."""
    total, through = 1.0, 1.0
    for a in acceptance[:g]:
        through *= a
        total += through
    return total


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
    costs: BlockCosts | None = None  # measured costs: the block length of most expected tokens/s
    explore_every: int = 4  # with costs: every 4th speculative block drafts one more token than the best
    reached: list[float] = field(default_factory=list)  # decayed, per block position: drafted and reached
    accepted: list[float] = field(default_factory=list)  # ... and accepted

    def __post_init__(self):
        if self.costs is not None and self.adaptive:
            self.gamma = self.best_length()

    def acceptance(self) -> list[float]:
        """a_j for j = 1..gamma_max: accepted / reached at position j, with PRIOR_WEIGHT blocks of
        a prior. At the first position the prior is the probe's share; at later ones the probe's
        conditional share scaled by how the first position measures against the probe (the text
        got easier or harder), so a position not drafted yet follows what was measured before it.
        Past the probe's positions its last conditional share is carried on."""
        prior = self.costs.prior
        cond = [prior[0]] + [prior[j] / prior[j - 1] if prior[j - 1] > 0 else 0.0 for j in range(1, len(prior))]
        out: list[float] = []
        shift = 1.0
        for j in range(self.gamma_max):
            base = min(1.0, cond[min(j, len(cond) - 1)] * shift)
            reached = self.reached[j] if j < len(self.reached) else 0.0
            accepted = self.accepted[j] if j < len(self.accepted) else 0.0
            out.append((accepted + PRIOR_WEIGHT * base) / (reached + PRIOR_WEIGHT))
            if j == 0:
                shift = out[0] / cond[0] if cond[0] > 0 else 1.0
        return out

    def rate(self, g: int, acceptance: list[float] | None = None) -> float:
        """Expected tokens per second of a block of g drafted tokens (g >= 1), from the costs."""
        acceptance = self.acceptance() if acceptance is None else acceptance
        seconds = g * self.costs.draft_seconds + interpolate(self.costs.verify_seconds, g + 1)
        return expected_tokens(acceptance, g) / seconds

    def best_length(self) -> int:
        """The block length of most expected tokens per second (the shortest among equals)."""
        acceptance = self.acceptance()
        return max(range(1, self.gamma_max + 1), key=lambda g: (self.rate(g, acceptance), -g))

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
        if plain is None:  # measure a plain step once drafting has been measured
            return 0 if self.spec_steps >= 2 else self.gamma
        if spec is not None and plain > spec and self.plain_run < self.probe_every:
            return 0
        if self.costs is not None and self.spec_steps % self.explore_every == self.explore_every - 1:
            return min(self.gamma + 1, self.gamma_max)  # measure the position past the best length too
        return self.gamma

    def record_plain(self, tokens: int, seconds: float) -> None:
        self.plain_tokens = self.decay * self.plain_tokens + tokens
        self.plain_seconds = self.decay * self.plain_seconds + max(seconds, 0.0)
        self.plain_run += 1

    def record_spec(self, drafted: int, kept: int, tokens: int, seconds: float) -> None:
        self.spec_tokens = self.decay * self.spec_tokens + tokens
        self.spec_seconds = self.decay * self.spec_seconds + max(seconds, 0.0)
        self.spec_steps += 1
        self.plain_run = 0
        if self.costs is not None:
            if self.adaptive and drafted:
                self._record_positions(drafted, kept)
                self.gamma = self.best_length()
            return
        if self.adaptive and drafted:
            if kept == drafted:
                self.gamma = min(self.gamma + 1, self.gamma_max)
            elif kept < drafted // 2:
                self.gamma = max(self.gamma - 1, 1)

    def _record_positions(self, drafted: int, kept: int) -> None:
        """A block reached its positions 1..kept + 1 (up to `drafted`) and accepted 1..kept."""
        grow = max(0, drafted - len(self.reached))
        self.reached += [0.0] * grow
        self.accepted += [0.0] * grow
        for j in range(len(self.reached)):
            self.reached[j] *= self.decay
            self.accepted[j] *= self.decay
        for j in range(min(kept + 1, drafted)):
            self.reached[j] += 1.0
            self.accepted[j] += 1.0 if j < kept else 0.0
