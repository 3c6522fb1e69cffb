"""How much to draft: the block length from acceptance, and no drafting when it does not pay.

A speculative step pays only if it emits more tokens per second than a plain step would. Both
rates are measured while generating, on this machine: each step's wall time ends with the step's
one device read, which waits for the device, so the timing needs no extra synchronization. When
plain steps measure faster than speculative ones (a weak draft, a CPU where a multi-token pass is
not free), the policy takes plain steps and tries drafting again every `probe_every` steps, since
the text may turn drafting-friendly (prompt lookup finds repeats, say).

The first plain step is measured only after SPEC_FIRST speculative ones: the first blocks after a
prompt are often rejected, and on a CPU where a 1-token pass is cheap (float32 here: 16.6 against
22.5 ms for 3 tokens) two slow first blocks sent the policy to plain steps for much of the answer
(fp32, 8 held-out prompts: 148 of 360 steps plain, tau 1.41 against 1.78 for a fixed block of 3).
Most of that was the drafter's catch-up on the prompt, timed as the first block's draft until it
moved into the prefill (Drafter.prefill); with both, 13-26 steps plain, tau 1.65-1.68
(docs/experiments/first-block-measured-layer-front.md).

Within speculative steps the block length follows acceptance: one more after a fully accepted
block, one fewer after a block of which nothing was kept, never fewer than its floor (FLOOR drafts,
or the measured first block below). Pure bookkeeping: no model, no tensor.

The first block, where the user leaves it to viasd (no `-g`): the chain length that `--tree auto`'s
probe measured fastest on this machine (machine/first_block.py), never below FLOOR; UNMEASURED_START where
nothing was measured (`--tree off` or N, other modes). A measured first block is also the block's
floor (GenerationConfig.start_at_measured): it shrinks after empty blocks no further than the length
this machine's verify curve and the draft's acceptance favour. On a 2-core CPU the probe picks a
chain of 1 at int4 (raised to 2) and 3 in float32, whose verify curve is nearly flat from 2 to 6
tokens; starting at 5 cost about 2% against the best fixed block at int4, and shrinking to 2 in
float32 about 3% against a floor of 3 (docs/experiments/first-block-measured-layer-front.md).

Why these rules (docs/experiments/draft-policy-shrink-margin.md and docs/experiments/row-attention-one-call.md held-out prompts on a 2-core AVX-512 EPYC): the
earlier rule (one fewer after a block rejected before its middle, plain steps as soon as they
measured faster, and the draft stopping at confidence 0.15) averaged 1.5-1.6 tokens a pass and ran
2-6% behind the best fixed block of 3 drafts; shrinking only on empty blocks, a floor of 2, no
confidence stop and no plain steps measured 1.210x `ar` at int4 (fixed 3: 1.197x) and 1.287x in
float32 (fixed 3: 1.302x). Plain steps stay, for drafts that clearly do not pay (a draft that never
agrees), but only where they measure PLAIN_MARGIN faster over about 20 steps of each kind: over
about 5 steps the noise of the rates sends the policy to plain steps it loses by (int4, one run: a 10%
margin over ~5 steps 1.160x, no plain steps 1.189x, this margin and decay 1.174x, fixed 3 1.176x).
"""

from __future__ import annotations

from dataclasses import dataclass

FLOOR = 2  # drafts: an adaptive block never shrinks below this (unless it started below)
PLAIN_MARGIN = 0.20  # plain steps are taken only where they measure this much faster than drafting
SPEC_FIRST = 8  # speculative steps measured before the first plain step is (the first blocks are noisy)
UNMEASURED_START = 5  # the first block where no probe measured one (GenerationConfig.gamma's default)


@dataclass
class DraftPolicy:
    gamma: int  # the next block length
    gamma_max: int
    adaptive: bool = True  # False: always draft `gamma` tokens (--fixed)
    probe_every: int = 4  # plain steps between two tries of drafting, while drafting does not pay
    spec_first: int = SPEC_FIRST  # speculative steps before a plain step is measured
    floor: int = FLOOR  # an adaptive block never shrinks below this (unless it started below)
    decay: float = 0.95  # weight of the past in the running sums, per step of the same kind (~20 steps)
    spec_tokens: float = 0.0  # decayed sums of tokens and seconds, per kind of step
    spec_seconds: float = 0.0
    plain_tokens: float = 0.0
    plain_seconds: float = 0.0
    spec_steps: int = 0
    plain_run: int = 0  # plain steps since the last speculative one

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
            return 0 if self.spec_steps >= self.spec_first else self.gamma
        if spec is not None and plain > spec * (1 + PLAIN_MARGIN) and self.plain_run < self.probe_every:
            return 0
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
        if self.adaptive and drafted:
            if kept == drafted:
                self.gamma = min(self.gamma + 1, self.gamma_max)
            elif kept == 0 and self.gamma > self.floor:
                self.gamma -= 1
