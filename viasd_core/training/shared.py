"""What both distillation kinds share: the learning-rate schedule of the draft model's training
(draft_train.py) and of the EAGLE-3 head's (eagle_train.py)."""

from __future__ import annotations

import math


def cosine_lr(step: int, steps: int, warmup: int, lr: float, elapsed_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine from lr to 0.1 lr over the steps (or over the time budget, when
    `elapsed_fraction` of it is further along)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = max((step - warmup) / max(1, steps - warmup), elapsed_fraction)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
