"""Train an EAGLE-3 head (viasd_core.speculation.eagle.FeatureHead) for a target, from the target's own outputs:
the training loop (`train_head`) and the order it sees the records in (`epoch_order`).

Stages (functions, shared by `viasd distill --kind feature`, recipes/eagle_campaign.py and tests):

1. sequences       the target's own answers (teacher_answers.build_dataset: batched generation).
2. `teacher_pass`  (eagle_data.py) the target's features and next-token distributions, one
                   teacher-forced batched pass.
3. `init_head`     (eagle_init.py) a head in the published layout for the target.
4. `train_head`    soft cross-entropy against the target's distribution, with EAGLE-3's
                   training-time test (eagle_ttt.py: `ttt_loss`), so the later draft positions are
                   trained on the inputs they see when drafting. Resumable: a checkpoint (weights,
                   optimizer, step, best) every `checkpoint_every`.
5. `evaluate_head` (eagle_ttt.py) teacher-forced top-1 agreement with the target, per draft position.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from viasd_core.training.shared import cosine_lr, resolve_bf16
from viasd_core.speculation.eagle import FeatureHead
from viasd_core.errors import UsageError
from viasd_core.training.eagle_data import FeatureRecord
from viasd_core.training.eagle_ttt import ttt_loss


@dataclass
class HeadTrainConfig:
    steps: int = 2000
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    ttt_steps: int = 3
    max_len: int = 512
    bf16: Optional[bool] = None  # bfloat16 autocast; None: where bfloat16 products measure faster (machine/bf16.py)
    seed: int = 0
    eval_every: int = 200
    checkpoint_every: int = 100
    time_limit_s: Optional[float] = None
    # > 0 (with `lengths`): batches of similar length, from runs of this many batches (epoch_order)
    group_by_length: int = 0
    # a finished checkpoint planned for fewer steps goes on to `steps`: a warm restart (the learning
    # rate warms up again to `lr` and follows a new cosine over the added steps; the best weights so
    # far stay the best until an evaluation beats them)
    extend: bool = False


def draft_index(head: FeatureHead) -> torch.Tensor:
    """[vocab] int64 on the CPU: the draft index of each target id, -1 where the head cannot propose it."""
    index = torch.full((head.vocab_size,), -1, dtype=torch.long)
    index[head.to_target_ids(torch.arange(head.draft_vocab_size, device=head.d2t.device)).cpu()] = torch.arange(head.draft_vocab_size)
    return index


def _trainable(head: FeatureHead):
    return [p for n, p in head.named_parameters() if not n.startswith("embed_tokens.")]


def epoch_order(n: int, batch_size: int, seed: int, epoch: int, lengths: Optional[Sequence[int]] = None,
                group: int = 0) -> list[int]:
    """One epoch's order of the record indices 0..n-1, seeded by `seed` and `epoch` (a resumed run
    sees the same order): shuffled; with `lengths` and `group` > 0, grouped by length as
    transformers' LengthGroupedSampler does: each run of group * batch_size shuffled indices is
    sorted by length and cut into batches, and the whole batches are shuffled (n % batch_size
    records sit out that epoch). A batch is padded to its longest sequence, so similar lengths waste
    less of every step (the sequences of a run are still a random draw, and a batch's place in the
    epoch is random)."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    if not group or lengths is None or n < batch_size:
        return order
    run = group * batch_size
    batches = []
    for lo in range(0, n, run):
        part = sorted(order[lo : lo + run], key=lambda i: -lengths[i])
        batches += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    # whole batches only (the shuffle leaves out a different n % batch_size records each epoch), so
    # that the next epoch's batches start aligned too
    batches = [b for b in batches if len(b) == batch_size]
    rng.shuffle(batches)
    return [i for batch in batches for i in batch]


def padded_positions(order: Sequence[int], batch_size: int, lengths: Sequence[int]) -> int:
    """Positions the batches of `order` compute, each padded to its longest sequence."""
    return sum(len(order[b : b + batch_size]) * max(lengths[i] for i in order[b : b + batch_size])
               for b in range(0, len(order), batch_size))


def train_head(head: FeatureHead, records: Sequence[FeatureRecord], config: HeadTrainConfig,
               checkpoint: Optional[Path] = None, eval_fn: Optional[Callable[[FeatureHead], float]] = None,
               log: Callable[[str], None] = lambda msg: None, lengths: Optional[Sequence[int]] = None) -> dict:
    """Train `head` on `records`; resumes from `checkpoint` when it exists and writes it every
    `checkpoint_every` steps (temporary file, then rename). With `eval_fn` (higher is better) the best
    evaluated weights are kept. `lengths` (each record's token count) lets `config.group_by_length`
    batch similar lengths together. Returns the training log (losses per window, evaluations, wall time)."""
    device = head.fc.weight.device
    bf16 = resolve_bf16(config.bf16, device, log)
    t2d_index = draft_index(head)
    params = _trainable(head)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=config.lr, betas=(0.9, 0.95))
    state = {"step": 0, "epoch": 0, "order": [], "losses": [], "evals": [], "best": None, "wall": 0.0,
             "steps": config.steps}
    if checkpoint is not None and Path(checkpoint).exists():
        saved = torch.load(checkpoint, weights_only=True)
        planned = saved["state"].get("steps", config.steps)
        extending = config.extend and planned < config.steps and saved["state"]["step"] >= planned
        if planned != config.steps and not extending:  # the learning rate follows a cosine over the planned steps
            raise UsageError(f"{checkpoint} was trained towards {planned} steps, not {config.steps}: "
                             f"resume with {planned} steps, or remove it to start again"
                             + (" (only a finished run can be extended)" if config.extend else ""))
        head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        if extending:
            state["restarts"] = state.get("restarts", []) + [planned]
            state["steps"] = config.steps
            log(f"extending {checkpoint}: a warm restart at step {planned} towards {config.steps} steps")
        log(f"resumed at step {state['step']} from {checkpoint}")
    head.train()
    for p in params:
        p.requires_grad_(True)
    t0 = time.perf_counter() - state["wall"]
    window: list[float] = []
    while state["step"] < config.steps:
        step = state["step"]
        if len(state["order"]) < config.batch_size:
            more = epoch_order(len(records), config.batch_size, config.seed, state["epoch"], lengths,
                               config.group_by_length)
            state["epoch"] += 1
            state["order"] = state["order"] + more
        idx, state["order"] = state["order"][: config.batch_size], state["order"][config.batch_size :]
        elapsed = time.perf_counter() - t0
        start = max(state.get("restarts", [0]))  # the schedule restarts at the last extension
        lr = cosine_lr(step - start, config.steps - start, config.warmup, config.lr,
                       elapsed / config.time_limit_s if config.time_limit_s else 0.0)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, acc = ttt_loss(head, [records[i] for i in idx], t2d_index, config.ttt_steps, max_len=config.max_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        window.append(loss.item())
        state["step"] = step = step + 1
        state["wall"] = time.perf_counter() - t0
        last = step >= config.steps or (config.time_limit_s is not None and state["wall"] > config.time_limit_s)
        if step % 25 == 0 or last:
            state["losses"].append({"step": step, "loss": sum(window) / len(window), "acc": acc})
            log(f"step {step}/{config.steps} loss {sum(window) / len(window):.3f} acc {' '.join(f'{a:.2f}' for a in acc)} "
                f"lr {lr:.1e} {state['wall']:.0f}s")
            window = []
        if eval_fn is not None and (step % config.eval_every == 0 or last):
            head.eval()
            score = float(eval_fn(head))
            head.train()
            state["evals"].append({"step": step, "score": score})
            if state["best"] is None or score > state["best"]["score"]:
                state["best"] = {"step": step, "score": score,
                                 "weights": {k: v.detach().clone() for k, v in head.state_dict().items()}}
            log(f"step {step}: held-out agreement {score:.4f} (best {state['best']['score']:.4f} at step {state['best']['step']})")
        if checkpoint is not None and (step % config.checkpoint_every == 0 or last):
            tmp = Path(checkpoint).with_name(f".{Path(checkpoint).name}.tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
            os.replace(tmp, checkpoint)
        if last:
            break
    head.eval()
    head.requires_grad_(False)
    if state["best"] is not None:
        head.load_state_dict(state["best"]["weights"])
        log(f"kept the weights of step {state['best']['step']} (held-out agreement {state['best']['score']:.4f})")
    return {"steps": state["step"], "losses": state["losses"], "evals": state["evals"],
            "best_step": state["best"]["step"] if state["best"] else state["step"], "train_wall_s": round(state["wall"], 1),
            "bf16_autocast": bf16, "restarts": state.get("restarts", [])}
