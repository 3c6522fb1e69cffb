"""What both distillation kinds share: the learning-rate schedule of the draft model's training
(draft_train.py) and of the EAGLE-3 head's (eagle_train.py), whether to train in bfloat16, and
the output folder: checked before the target loads, kept when it cannot be written at the end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import torch

from viasd_core import paths
from viasd_core.machine.bf16 import bf16_products_pay
from viasd_core.errors import ViasdError


def cosine_lr(step: int, steps: int, warmup: int, lr: float, elapsed_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine from lr to 0.1 lr over the steps (or over the time budget, when
    `elapsed_fraction` of it is further along)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = max((step - warmup) / max(1, steps - warmup), elapsed_fraction)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def resolve_bf16(choice: Optional[bool], device: torch.device | str, log: Callable[[str], None] = lambda m: None) -> bool:
    """`choice` where the user or a recipe set it, else bfloat16 autocast where bfloat16 products
    measure faster on this machine (machine/bf16.py; logged)."""
    if choice is not None:
        return choice
    pays = bf16_products_pay(device)
    log(f"training in {'bfloat16 autocast' if pays else 'float32'}: bfloat16 products "
        f"{'pay' if pays else 'do not pay'} on this {torch.device(device).type} (measured)")
    return pays


def check_out(out: str | Path, work: str | Path | None = None) -> Path:
    """--out (a folder replaced atomically) and --work, before the target loads: paths.check_*
    (UsageError, exit 2). Returns --out as a Path."""
    if work is not None:
        paths.check_writable_dir(work, "--work")
    return paths.check_replaceable_dir(out, "--out")


def save_or_fall_back(out: Path, save: Callable[[Path], Path]) -> Path:
    """`save(out)`; if that fails at the end of training (OSError: the disk filled, the folder
    vanished), `save` into a new folder of the cache, else of the current folder
    (paths.write_elsewhere), and fail naming it: the trained weights are kept."""
    try:
        return save(out)
    except OSError as e:
        reason = e.strerror or str(e)
    name = out.name or "draft"
    folder = paths.write_elsewhere(lambda f: save(f / name), "distill")
    if folder is None:
        raise ViasdError(f"could not write --out '{out}' ({reason}), nor to the cache or the current folder: "
                         "the trained weights are lost")
    raise ViasdError(f"could not write --out '{out}' ({reason}): the draft is in '{folder / name}' instead")
