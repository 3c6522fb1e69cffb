"""What both distillation kinds share: the learning-rate schedule of the draft model's training
(draft_train.py) and of the EAGLE-3 head's (eagle_train.py), and whether to train in bfloat16."""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch


def cosine_lr(step: int, steps: int, warmup: int, lr: float, elapsed_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine from lr to 0.1 lr over the steps (or over the time budget, when
    `elapsed_fraction` of it is further along)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = max((step - warmup) / max(1, steps - warmup), elapsed_fraction)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _matmul_seconds(dtype: torch.dtype, device: torch.device, rounds: int = 3) -> float:
    """The best of `rounds` timings of one training-sized product (1024 x 1152 by 1152 x 576)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1152, generator=g).to(device, dtype)
    b = torch.randn(1152, 576, generator=g).to(device, dtype)
    best = float("inf")
    for _ in range(rounds + 1):  # the first one warms up
        t0 = time.perf_counter()
        float((a @ b)[0, 0])  # the read waits for the device
        best = min(best, time.perf_counter() - t0)
    return best


def bf16_autocast_pays(device: torch.device | str = "cpu",
                       seconds: Callable[[torch.dtype, torch.device], float] = _matmul_seconds) -> bool:
    """Whether bfloat16 autocast makes training's matrix products faster here. On a GPU: where it
    supports bfloat16. On a CPU it is measured: with bfloat16 instructions (AVX-512 BF16, AMX) a
    bfloat16 product is several times faster than a float32 one; without them (an AVX2-only CPU)
    it measured 16 times slower (a training step of the campaign's head: 118 s against 7.5 s)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return seconds(torch.bfloat16, device) < 0.8 * seconds(torch.float32, device)


def resolve_bf16(choice: Optional[bool], device: torch.device | str, log: Callable[[str], None] = lambda m: None) -> bool:
    """`choice` where the user or a recipe set it, else what bf16_autocast_pays measures (logged)."""
    if choice is not None:
        return choice
    pays = bf16_autocast_pays(device)
    log(f"training in {'bfloat16 autocast' if pays else 'float32'}: bfloat16 products "
        f"{'pay' if pays else 'do not pay'} on this {torch.device(device).type} (measured)")
    return pays
