"""Train a draft model on the target's answers: cross-entropy on the target's argmax labels over the
draft vocabulary, AdamW with the shared cosine schedule, early stopping on a held-out score."""

from __future__ import annotations

import random
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from viasd_core.training.shared import cosine_lr
from viasd_core.training.teacher_answers import Record

IGNORE = -100


def _batch(records: Sequence[Record], inverse: torch.Tensor, max_len: int, pad_id: int):
    """Right-padded (input_ids, attention_mask, draft-space labels) for next-token training."""
    rows = []
    for r in records:
        ids = r.input_ids
        lab = torch.full_like(ids, IGNORE)
        n = r.labels.numel()
        lab[r.prompt_len - 1 : r.prompt_len - 1 + n] = inverse[r.labels]
        if ids.numel() > max_len:  # keep the end (where the labels are)
            ids, lab = ids[-max_len:], lab[-max_len:]
        rows.append((ids, lab))
    width = max(ids.numel() for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : ids.numel()], mask[i, : ids.numel()], labels[i, : ids.numel()] = ids, 1, lab
    return input_ids, mask, labels


def train_draft(
    draft,
    records: Sequence[Record],
    vocab_map: torch.Tensor,
    steps: int = 1000,
    batch_size: int = 8,
    lr: float = 5e-4,
    warmup: int = 50,
    weight_decay: float = 0.0,
    max_len: int = 512,
    seed: int = 0,
    pad_id: int = 0,
    log_every: int = 0,
    log: Optional[Callable[[str], None]] = None,
    time_limit_s: Optional[float] = None,
    bf16_autocast: bool = False,
    eval_fn: Optional[Callable[[object], float]] = None,
    eval_every: int = 0,
) -> list[float]:
    """Train `draft` on the target's argmax labels (cross-entropy over the draft vocabulary).

    The shared embedding stays frozen. Labels outside `vocab_map` are ignored (the draft cannot
    express them). AdamW, linear warm-up then cosine decay; one fixed seed for the batch order.
    `time_limit_s` ends training early (the cosine schedule then follows elapsed time). `bf16_autocast` runs the
    matmuls in bfloat16 (master weights stay fp32; much faster on CPUs with AMX). With `eval_fn`
    (draft -> score, higher is better; e.g. agreement on held-out prompts of the TRAINING set) run
    every `eval_every` steps, the best-scoring weights are restored at the end (early stopping:
    a small draft memorises a small distillation set within a few epochs).
    Returns the loss per step; `draft.viasd_train_log` holds the evaluations.
    """
    device = draft.get_input_embeddings().weight.device
    inverse = torch.full((draft.config.vocab_size,), IGNORE, dtype=torch.long)
    inverse[vocab_map.cpu()] = torch.arange(vocab_map.numel())
    embed = draft.get_input_embeddings()
    embed_grad = embed.weight.requires_grad
    params = [p for n, p in draft.named_parameters() if not n.startswith("model.embed_tokens.")]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98)
    )

    def lr_at(step: int) -> float:  # the schedule follows whichever budget runs out first
        return cosine_lr(step, steps, warmup, lr, (time.perf_counter() - t0) / time_limit_s if time_limit_s else 0.0)

    rng = random.Random(seed)
    torch.manual_seed(seed)
    order: list[int] = []
    losses: list[float] = []
    evals: list[dict] = []
    best = None
    t0 = time.perf_counter()
    draft.train()
    embed.weight.requires_grad_(False)
    try:
        for step in range(steps):
            if len(order) < batch_size:
                more = list(range(len(records)))
                rng.shuffle(more)
                order += more
            idx, order = order[:batch_size], order[batch_size:]
            input_ids, mask, labels = _batch([records[i] for i in idx], inverse, max_len, pad_id)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16_autocast):
                logits = draft(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten(), ignore_index=IGNORE)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.detach().item())
            if log and log_every and (step + 1) % log_every == 0:
                recent = losses[-log_every:]
                log(f"step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f} lr {lr_at(step):.2e} {time.perf_counter() - t0:.0f}s")
            last = step + 1 == steps or (time_limit_s is not None and time.perf_counter() - t0 > time_limit_s)
            if eval_fn is not None and eval_every and ((step + 1) % eval_every == 0 or last):
                draft.eval()
                score = float(eval_fn(draft))
                draft.train()
                evals.append({"step": step + 1, "score": score, "loss": sum(losses[-eval_every:]) / len(losses[-eval_every:])})
                if best is None or score > best[0]:
                    best = (score, step + 1, {k: v.detach().clone() for k, v in draft.named_parameters() if v.requires_grad})
                if log:
                    log(f"step {step + 1}: held-out score {score:.4f} (best {best[0]:.4f} at step {best[1]})")
            if last and step + 1 < steps:
                if log:
                    log(f"time limit reached after {step + 1} steps")
                break
    finally:
        embed.weight.requires_grad_(embed_grad)
        draft.eval()
    if best is not None:
        with torch.no_grad():
            named = dict(draft.named_parameters())
            for k, v in best[2].items():
                named[k].copy_(v)
        if log:
            log(f"restored the weights of step {best[1]} (held-out score {best[0]:.4f})")
    draft.viasd_train_log = {"evals": evals, "best_step": best[1] if best else len(losses)}
    return losses
