"""The VIA-SD tier walk as pure functions (docs/algorithm.md section 2), shared by the engine and replay.

The gate of drafted token j is r_j = slim_prob(v_j) / max slim_prob, from the slim verifier's
logits; its tier is accept (r >= theta_accept: keep the draft token), slim (theta_slim <= r <
theta_accept: the slim verifier's token) or full (r < theta_slim: the target decides). Both the
gate and that threshold rule live in viasd_kernels (`route_block`, `tiers_from_gate`). One more
condition (`unsure_to_full`): a position where
the slim's own top-1 probability (its confidence, c_j = max slim_prob) is below theta_confidence
goes to full whatever r says. r alone cannot see a strong
but unsure slim view: r is 1 whenever the draft agrees with the slim, however close its top two.
The whole rule is `route_tiers` (the kernels' threshold rule on the gate, then the confidence
condition): the engine (`block_tiers`, on a block route_block routed) and calibration's replay (on
recorded gates) both call it, so the two cannot drift apart. This module walks one block through the
tiers (`walk_block`) and replays recorded blocks with it (calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from viasd_kernels import TIER_ACCEPT, TIER_FULL, TIER_SLIM, RouteResult, tiers_from_gate

from viasd_core.speculation.stats import TIERS

OFF = 1.5  # a threshold above 1 switches its tier off: the gate r is at most 1


@dataclass(frozen=True)
class Thresholds:
    accept: float  # theta_accept
    slim: float  # theta_slim
    confidence: float = 0.0  # theta_confidence: below it the target decides (0: no condition)

    @property
    def active(self) -> bool:
        """False when both tiers are off: the slim pass would be wasted, viasd is plain sd."""
        return (self.accept <= 1.0 or self.slim <= 1.0) and self.confidence <= 1.0

    def __post_init__(self):
        if not 0.0 <= self.slim <= self.accept <= 2.0:
            raise ValueError(f"need 0 <= theta_slim <= theta_accept <= 2 (above 1 = off), got {self.slim}, {self.accept}")
        if not 0.0 <= self.confidence <= 2.0:
            raise ValueError(f"need 0 <= theta_confidence <= 2 (above 1 = off), got {self.confidence}")


def slim_confidence(route: RouteResult, num_draft: int) -> torch.Tensor:
    """c_j = the slim's top-1 probability at block positions j < num_draft: [G] float32 (greedy, T = 1)."""
    return torch.exp(route.max_logit[:num_draft] - route.lse[:num_draft])


def unsure_to_full(tiers: torch.Tensor, confidence: torch.Tensor, thresholds: Thresholds) -> torch.Tensor:
    """The confidence condition on tiers the kernels' rule gave: full wherever the slim's confidence
    is below theta_confidence (a float32 comparison, like the kernels'). [N] int8."""
    if thresholds.confidence <= 0.0:
        return tiers
    unsure = confidence.float() < torch.tensor(thresholds.confidence, dtype=torch.float32)
    return torch.where(unsure, torch.tensor(TIER_FULL, dtype=torch.int8), tiers)


def route_tiers(gate: torch.Tensor, confidence: torch.Tensor, thresholds: Thresholds) -> torch.Tensor:
    """The tier of every position from recorded gates and confidences: the kernels' rule on the
    gate (as route_block applied it), then `unsure_to_full`. [N] int8."""
    return unsure_to_full(tiers_from_gate(gate, thresholds.accept, thresholds.slim), confidence, thresholds)


def block_tiers(route: RouteResult, num_draft: int, thresholds: Thresholds) -> torch.Tensor:
    """The tier of each of the `num_draft` drafted positions of a block route_block routed: `route_tiers`
    on its gates and the slim's confidences. [num_draft] int8."""
    return route_tiers(route.gate[:num_draft], slim_confidence(route, num_draft), thresholds)


def walk_block(tiers: Sequence[int], draft_eq_slim: Sequence[bool], target_agrees: Callable[[int], bool]) -> list[str]:
    """The tier name of each emitted position 0, 1, ... of one block of G = len(tiers) drafts.

    Names: 'accept' (the draft's token), 'slim' (the slim verifier's token), 'full' and 'bonus'
    (the target's token). A slim token that differs from the draft ends the block
    (draft_eq_slim[j] is False); the first 'full' position hands the rest of the block to the
    target: `target_agrees(j)` (whether the target's token at j equals the draft's) is called
    only from there on, so the caller runs its one target pass lazily on the first call. The
    target's tokens run until its first disagreement, or through all G positions and its bonus
    token at G. A block kept whole without the target ends with the slim's token at G ('slim').
    """
    names: list[str] = []
    num_draft = len(tiers)
    for j in range(num_draft):
        if tiers[j] == TIER_ACCEPT:
            names.append("accept")
        elif tiers[j] == TIER_SLIM:
            names.append("slim")
            if not draft_eq_slim[j]:
                return names
        else:  # full: the target decides from j on
            for i in range(j, num_draft):
                names.append("full")
                if not target_agrees(i):
                    return names
            names.append("bonus")
            return names
    names.append("slim")  # the whole block kept without the target: the slim's token at G
    return names


@dataclass(frozen=True)
class BlockRecord:
    """One recorded speculative block, for replaying tier decisions offline (calibration).

    Per position j < G: the gate value (from route_block), whether the draft token equals the
    target's greedy choice, whether the slim's argmax equals the target's, whether the draft
    token equals the slim's argmax, the slim's confidence (slim_confidence); `slim_bonus_ok`:
    the slim's token after the whole block equals the target's. The target's choices are
    teacher-forced on the drafted block.
    """

    gate: tuple[float, ...]
    draft_ok: tuple[bool, ...]
    slim_ok: tuple[bool, ...]
    draft_eq_slim: tuple[bool, ...]
    slim_bonus_ok: bool
    confidence: tuple[float, ...]

    @classmethod
    def from_choices(cls, gate: Sequence[float], block: Sequence[int], slim_argmax: Sequence[int],
                     target_argmax: Sequence[int], confidence: Sequence[float]) -> "BlockRecord":
        """From the G gate values, the G drafted tokens, the G + 1 slim / target argmaxes and the
        G slim confidences."""
        num_draft = len(block)
        return cls(
            gate=tuple(float(r) for r in gate),
            draft_ok=tuple(block[j] == target_argmax[j] for j in range(num_draft)),
            slim_ok=tuple(slim_argmax[j] == target_argmax[j] for j in range(num_draft)),
            draft_eq_slim=tuple(block[j] == slim_argmax[j] for j in range(num_draft)),
            slim_bonus_ok=slim_argmax[num_draft] == target_argmax[num_draft],
            confidence=tuple(float(c) for c in confidence),
        )


@dataclass
class ReplayOutcome:
    tiers: list[str] = field(default_factory=list)  # the tier of every emitted token, in order
    wrong: int = 0  # emitted tokens that differ from the target's greedy choice
    steps: int = 0
    target_passes: int = 0
    slim_passes: int = 0
    drafted: int = 0
    target_positions: int = 0  # positions the target's passes ran, in all (a skipped step's tokens join the next)
    slim_positions: int = 0

    @property
    def tokens(self) -> int:
        return len(self.tiers)

    @property
    def tier_counts(self) -> dict[str, int]:
        return {name: self.tiers.count(name) for name in TIERS}

    @property
    def fidelity(self) -> float | None:
        """Fraction of emitted tokens equal to the target's choice; None (not measured) with none."""
        return 1.0 - self.wrong / self.tokens if self.tokens else None


def _emitted_ok(b: BlockRecord, j: int, name: str) -> bool:
    """Whether the token emitted at position j under tier `name` is the target's choice."""
    if name == "accept":
        return b.draft_ok[j]
    if name == "slim":
        return b.slim_ok[j] if j < len(b.gate) else b.slim_bonus_ok
    return True  # full / bonus: the target's own token


def replay(blocks: list[BlockRecord], thresholds: Thresholds) -> ReplayOutcome:
    """The engine's viasd walk (walk_block) over recorded blocks, with teacher-forced labels.

    Tiers come from the recorded gates and confidences through `route_tiers`, so a replay with
    the thresholds of a recorded viasd run routes exactly as that run did. Counts emitted tokens,
    tokens that differ from the target's greedy choice, and passes.
    """
    res = ReplayOutcome()
    all_gates = torch.tensor([r for b in blocks for r in b.gate], dtype=torch.float32)
    all_confidence = torch.tensor([c for b in blocks for c in b.confidence], dtype=torch.float32)
    all_tiers = route_tiers(all_gates, all_confidence, thresholds).tolist()
    start = 0
    unseen = 0  # tokens committed since the target last ran: its next pass runs them too
    for b in blocks:
        num_draft = len(b.gate)
        tiers = all_tiers[start : start + num_draft]
        start += num_draft
        res.steps += 1
        if thresholds.active:
            res.slim_passes += 1
            res.slim_positions += num_draft + 1
        res.drafted += num_draft
        names = walk_block(tiers, b.draft_eq_slim, b.draft_ok.__getitem__)
        if "full" in names:
            res.target_passes += 1
            res.target_positions += unseen + num_draft + 1
            unseen = 0
        else:
            unseen += len(names)
        res.wrong += sum(not _emitted_ok(b, j, name) for j, name in enumerate(names))
        res.tiers.extend(names)
    return res
