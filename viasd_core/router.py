"""The VIA-SD tier router as pure functions (ALGORITHM.md section 2).

Gate signal per drafted token j: r_j = slim_prob(v_j) / max slim_prob, computed from the slim
verifier's logits. Tiers: r >= accept -> keep the draft token; slim <= r < accept -> the slim
verifier's token; r < slim -> the target decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIER_ACCEPT, TIER_SLIM, TIER_FULL = 0, 1, 2
OFF = 1.5  # a threshold above 1 switches its tier off: the gate r is at most 1


@dataclass(frozen=True)
class Thresholds:
    accept: float  # theta_accept
    slim: float  # theta_slim

    @property
    def active(self) -> bool:
        """False when both tiers are off: the slim pass would be wasted, viasd is plain sd."""
        return self.accept <= 1.0 or self.slim <= 1.0

    def __post_init__(self):
        if not 0.0 <= self.slim <= self.accept <= 2.0:
            raise ValueError(f"need 0 <= theta_slim <= theta_accept <= 2 (above 1 = off), got {self.slim}, {self.accept}")


def gate_signal(slim_logits: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """r_j = exp(slim_logit[j, v_j] - max_v slim_logit[j, v]) for slim_logits [G(+1), V], draft_tokens [G]."""
    G = draft_tokens.shape[0]
    logits = slim_logits[:G].float()
    return (logits.gather(-1, draft_tokens[:, None])[:, 0] - logits.max(-1).values).exp()


def route_tiers(gate: torch.Tensor, thresholds: Thresholds) -> torch.Tensor:
    """gate [G] float -> tiers [G] int8 (0 accept, 1 slim, 2 full)."""
    tiers = torch.full(gate.shape, TIER_FULL, dtype=torch.int8, device=gate.device)
    tiers[gate >= thresholds.slim] = TIER_SLIM
    tiers[gate >= thresholds.accept] = TIER_ACCEPT
    return tiers


@dataclass(frozen=True)
class BlockRecord:
    """One recorded speculative block, for replaying tier decisions offline (calibration).

    Per position j < G: the gate value, whether the draft token equals the target's greedy
    choice, whether the slim's argmax equals the target's; `slim_bonus_ok`: the slim's token
    after the whole block equals the target's.
    """

    gate: tuple[float, ...]
    draft_ok: tuple[bool, ...]
    slim_ok: tuple[bool, ...]
    draft_eq_slim: tuple[bool, ...]
    slim_bonus_ok: bool


@dataclass
class ReplayOutcome:
    tokens: int = 0
    wrong: int = 0
    steps: int = 0
    target_passes: int = 0
    slim_passes: int = 0
    drafted: int = 0
    tier_counts: dict | None = None

    @property
    def fidelity(self) -> float:
        return 1.0 - self.wrong / self.tokens if self.tokens else 1.0


def replay(blocks: list[BlockRecord], thresholds: Thresholds) -> ReplayOutcome:
    """Simulate the viasd walk of engine._route_viasd over recorded blocks (teacher-forced labels).

    Counts emitted tokens, tokens that differ from the target's greedy choice, and passes.
    """
    res = ReplayOutcome(tier_counts={"accept": 0, "slim": 0, "full": 0, "bonus": 0})
    for b in blocks:
        res.steps += 1
        res.slim_passes += 1 if thresholds.active else 0
        res.drafted += len(b.gate)
        G = len(b.gate)
        full = False
        for j in range(G + 1):
            if full:  # the target decides: correct by construction
                res.tokens += 1
                res.tier_counts["full" if j < G else "bonus"] += 1
                if j == G or not b.draft_ok[j]:
                    break
                continue
            if j == G:
                res.tokens += 1
                res.wrong += 0 if b.slim_bonus_ok else 1
                res.tier_counts["slim"] += 1
                break
            r = b.gate[j]
            if r >= thresholds.accept:
                res.tokens += 1
                res.wrong += 0 if b.draft_ok[j] else 1
                res.tier_counts["accept"] += 1
            elif r >= thresholds.slim:
                res.tokens += 1
                res.wrong += 0 if b.slim_ok[j] else 1
                res.tier_counts["slim"] += 1
                if not b.draft_eq_slim[j]:
                    break
            else:
                full = True
                res.target_passes += 1
                res.tokens += 1
                res.tier_counts["full"] += 1
                if not b.draft_ok[j]:
                    break
    return res
