"""Train an EAGLE-3 head (viasd_core.decoding.eagle.FeatureHead) for a target, from the target's own outputs.

Stages (functions, shared by `viasd distill --kind feature`, recipes/eagle_campaign.py and tests):

1. sequences       the target's own answers (teacher_answers.build_dataset: batched generation).
2. `teacher_pass`  ONE teacher-forced, batched target pass per batch of sequences gives, at every
                   position, the three layer states the head reads and the target's next-token
                   distribution (its top-k, as soft labels): thousands of labels per second,
                   where label-by-label generation gives tens.
3. `init_head`     a head in the published layout for the target: shared (frozen) embedding, a
                   reduced output vocabulary (the ids the target emits most, `d2t`/`t2d` maps),
                   lm_head rows and final norm copied from the target.
4. `train_head`    soft cross-entropy against the target's distribution, with EAGLE-3's
                   training-time test: `ttt_logits` unrolls `steps` drafting steps in parallel,
                   step s feeding each position the head's own output of step s - 1, so the
                   later draft positions are trained on the inputs they see when drafting.
                   Resumable: a checkpoint (weights, optimizer, step, best) every `checkpoint_every`.
5. `evaluate_head` teacher-forced top-1 agreement with the target, per draft position.

Label alignment: head position p reads the target's features at p and the token at p + 1, and
predicts the token at p + 2, whose target distribution is the one at target position p + 1.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from viasd_core.decoding import attention
from viasd_core.training.shared import cosine_lr, resolve_bf16
from viasd_core.decoding.eagle import LAYER_IDS_KEY, FeatureHead
from viasd_core.errors import UsageError
from viasd_core.decoding.model import model_shape

TOPK = 20  # soft labels kept per position


@dataclass
class FeatureRecord:
    """One teacher-forced sequence: tokens, the target's features and next-token distribution at each position."""

    tokens: torch.Tensor  # [L] int64
    features: torch.Tensor  # [L, 3H] bfloat16: states entering the feature layers
    top_ids: torch.Tensor  # [L, K] int64: the target's top-k next-token ids after position p
    top_logp: torch.Tensor  # [L, K] float32: their log-probabilities
    prompt_len: int
    category: str = ""
    focus: Optional[torch.Tensor] = None  # [L, S] loss weight per head position and draft step (None: all 1)

    @property
    def labels(self) -> torch.Tensor:
        """The target's argmax at the generated positions (what teacher_answers.choose_vocab counts)."""
        return self.top_ids[max(self.prompt_len - 1, 0) : -1, 0]

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "features": self.features, "top_ids": self.top_ids, "top_logp": self.top_logp,
                "prompt_len": self.prompt_len, "category": self.category, "focus": self.focus}


def default_feature_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice (also vLLM's default): a low, a middle and a high layer, (2, L//2, L-3);
    a target too shallow for those takes its last three layers' inputs."""
    if n_layers < 3:
        raise UsageError(f"a feature head reads three layers: this target has only {n_layers}")
    layers = (2, n_layers // 2, n_layers - 3)
    return layers if len(set(layers)) == 3 and layers == tuple(sorted(layers)) else (n_layers - 3, n_layers - 2, n_layers - 1)


@torch.no_grad()
def teacher_pass(target, sequences: Sequence[tuple[list[int], int, str]], layers: Sequence[int], batch_size: int = 8,
                 topk: int = TOPK, progress: Optional[Callable[[int, int], None]] = None) -> list[FeatureRecord]:
    """Teacher-force `sequences` ((tokens, prompt_len, category)) through the HF `target` in right-padded
    batches; returns their FeatureRecords (features in bfloat16, the top-k log-probabilities).

    The next-token distribution is needed only from the last prompt position on (what the head is
    trained and scored on: `soft_targets`, `labels`): the output layer and its log-softmax run from
    there (`logits_to_keep`), and earlier positions hold id 0 at log-probability -inf. On the
    campaign's answers, half the positions are prompt."""
    device = target.get_input_embeddings().weight.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    out: list[Optional[FeatureRecord]] = [None] * len(sequences)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(sequences[i][0]) for i in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, i in enumerate(chunk):
            toks = sequences[i][0]
            ids[b, : len(toks)] = torch.tensor(toks)
            mask[b, : len(toks)] = 1
        first = [min(max(sequences[i][1] - 1, 0), len(sequences[i][0]) - 1) for i in chunk]
        keep = width - min(first)  # the batch's positions from its earliest last-prompt position on
        res = target(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                     use_cache=False, logits_to_keep=keep)
        feats = torch.cat([res.hidden_states[l] for l in layers], dim=-1).to(torch.bfloat16).cpu()
        top_logp, top_ids = torch.log_softmax(res.logits.float(), dim=-1).topk(topk, dim=-1)
        top_logp, top_ids = top_logp.cpu(), top_ids.cpu()
        for b, i in enumerate(chunk):
            toks, prompt_len, category = sequences[i]
            n = len(toks)
            row_ids = torch.zeros(n, topk, dtype=torch.long)
            row_logp = torch.full((n, topk), -math.inf)
            lo, off = first[b], width - keep  # logits row j is position off + j
            row_ids[lo:] = top_ids[b, lo - off : n - off]
            row_logp[lo:] = top_logp[b, lo - off : n - off]
            out[i] = FeatureRecord(ids[b, :n].clone(), feats[b, :n].clone(), row_ids, row_logp, prompt_len, category)
        if progress:
            progress(min(start + batch_size, len(order)), len(order))
    return out  # type: ignore[return-value]


def save_records(records: Sequence, path: Path) -> None:
    """Write records (anything with `to_dict()`) to `path` (a temporary file, then a rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save([r.to_dict() for r in records], tmp)
    os.replace(tmp, path)


def load_records(path: Path) -> list[FeatureRecord]:
    return [FeatureRecord(**d) for d in torch.load(path, weights_only=True)]


# ---------------------------------------------------------------------- the head
def head_config(target_config, layers: Sequence[int], draft_vocab: int) -> dict:
    """config.json of a head for `target_config` (published layout: a one-layer Llama config)."""
    from viasd_core.loading.draft_model import rope_config

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "hidden_act")
    cfg = {k: getattr(target_config, k) for k in keys if getattr(target_config, k, None) is not None}
    cfg["head_dim"] = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    theta = rope_config(target_config).get("rope_theta")
    if theta is not None:
        cfg["rope_theta"] = theta
    cfg.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "vocab_size": int(target_config.vocab_size), "draft_vocab_size": int(draft_vocab),
                "target_hidden_size": target_config.hidden_size, LAYER_IDS_KEY: list(layers)})
    return cfg


def init_head(target, layers: Sequence[int], vocab_map: torch.Tensor, seed: int = 0) -> FeatureHead:
    """A new head for the HF `target` over draft ids `vocab_map` (sorted target ids): the target's
    embedding shared, its final norm and the lm_head rows of `vocab_map` copied; `fc` starts as
    "take the highest feature layer", the rest at PyTorch's default initialisation."""
    model_shape(target)  # refuses unsupported families with one line
    torch.manual_seed(seed)
    cfg = head_config(target.config, layers, vocab_map.numel())
    embed = target.get_input_embeddings()
    head = FeatureHead(cfg, tuple(layers), embed=embed)
    H = cfg["hidden_size"]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H :].copy_(torch.eye(H))
        head.norm.weight.copy_(target.get_decoder().norm.weight.float())
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab_map].float())
        head.d2t.copy_(vocab_map - torch.arange(vocab_map.numel()))
        head.t2d.zero_()
        head.t2d[vocab_map] = True
    return head.to(embed.weight.device)


# ---------------------------------------------------------------------- training-time test
def _shift(x: torch.Tensor, d: int, dim: int) -> torch.Tensor:
    """x moved d places later along `dim` (position q holds x[q - d]; zeros before)."""
    if d == 0:
        return x
    n = x.shape[dim]
    pad = torch.zeros_like(x.narrow(dim, 0, min(d, n)))
    return torch.cat([pad, x.narrow(dim, 0, n - min(d, n))], dim=dim)


def ttt_logits(head: FeatureHead, tokens: torch.Tensor, features: torch.Tensor, steps: int,
               rows: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """EAGLE-3's training-time test, all positions at once: logits [B, T, Vd] per drafting step.

    tokens [B, T + 1], features [B, T, 3H] (the target's, positions 0..T-1). Step 0 at position q is the
    head run on the target's features up to q (as when the head catches up); step s at q is the s-th
    drafted token after anchor q - s: the head's own step s - 1 output at q - 1 as its feature,
    attending to step-0 keys up to q - s and to step k's key at q - s + k (k = 1..s): the keys of
    steps 0..s concatenated under `attention.ttt_mask`. Rows q < s are not defined (zeros in, masked
    out of the loss). Teacher tokens are fed, as in EAGLE-3.
    Equal to drafting with `FeatureHead.forward` (tests/test_feature_drafter.py checks it).
    rows [B, T] (bool): the output layer runs only there and each step's logits are [N, Vd] in
    `rows` order (training skips the prompt positions, which have no label: about half of them).
    """
    B, T = features.shape[:2]
    if head.max_len < T:
        head.allocate(T)
    cos, sin = head.rope_cos[:T], head.rope_sin_signed[:T]
    emb = head.embedding(tokens[:, 1 : T + 1]).to(head.dtype).detach()
    fused = head.fuse(features)
    keys, values, out = [], [], []
    for s in range(steps):
        q, k, v = head.qkv(emb, fused, cos, sin)
        keys.append(k)
        values.append(v)
        o = attention.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                             attention.ttt_mask(T, s, device=q.device))  # [B, T, heads * D]; scale 1/sqrt(D)
        hidden = head.finish(fused, o)
        out.append(head.logits(hidden if rows is None else hidden[rows]))
        fused = _shift(hidden, 1, 1)
    return out


def soft_targets(records: Sequence[FeatureRecord], t2d_index: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per record: the target distribution over draft ids for head positions 0..T-1 ([B, T, K] probs and
    draft indices; 0 past the end, renormalised over the ids the draft vocabulary holds)."""
    B, K = len(records), records[0].top_ids.shape[-1]
    probs = torch.zeros(B, T, K)
    idx = torch.zeros(B, T, K, dtype=torch.long)
    for b, r in enumerate(records):
        n = min(r.tokens.numel() - 1, T)  # head position p uses the distribution at target position p + 1
        if n <= 0:
            continue
        ids = r.top_ids[1 : n + 1]
        d = t2d_index[ids]
        p = r.top_logp[1 : n + 1].float().exp() * (d >= 0)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        start = max(r.prompt_len - 2, 0)  # train where the head drafts: predictions of generated tokens
        p[:start] = 0
        probs[b, :n], idx[b, :n] = p, d.clamp(min=0)
    return probs, idx


def make_batch(records: Sequence[FeatureRecord], max_len: int):
    """(tokens [B, T + 1], features [B, T, 3H], probs, idx) over the first max_len head positions."""
    T = min(max(r.tokens.numel() for r in records) - 1, max_len)
    B = len(records)
    tokens = torch.zeros(B, T + 1, dtype=torch.long)
    feats = torch.zeros(B, T, records[0].features.shape[-1], dtype=records[0].features.dtype)
    for b, r in enumerate(records):
        n = min(r.tokens.numel(), T + 1)
        tokens[b, :n] = r.tokens[:n]
        feats[b, : min(n, T)] = r.features[: min(n, T)]
    return tokens, feats, T


def focus_weights(records: Sequence[FeatureRecord], T: int, steps: int) -> torch.Tensor:
    """[B, T, steps] loss weights: each record's `focus` (on-policy training), else 1."""
    out = torch.ones(len(records), T, steps)
    for b, r in enumerate(records):
        if r.focus is not None:
            n, s = min(r.focus.shape[0], T), min(r.focus.shape[1], steps)
            out[b, :n, :s] = r.focus[:n, :s]
    return out


def ttt_loss(head: FeatureHead, records: Sequence[FeatureRecord], t2d_index: torch.Tensor, steps: int,
             decay: float = 0.8, max_len: int = 512, rows_only: bool = True) -> tuple[torch.Tensor, list[float]]:
    """Soft cross-entropy of every drafting step against the target (step s weighted decay**s, each
    position by its record's focus). Returns (loss, per-step top-1 agreement on the positions with labels).
    rows_only=False is the plain path (logits on every row, then the labelled ones picked): the same
    loss, kept to measure what skipping the prompt rows saves (benchmarks/experiments/campaign_measure.py)."""
    device = head.fc.weight.device
    tokens, feats, T = make_batch(records, max_len)
    probs, idx = soft_targets(records, t2d_index, T)
    focus = focus_weights(records, T, steps)
    tokens, feats, probs, idx, focus = tokens.to(device), feats.to(device), probs.to(device), idx.to(device), focus.to(device)
    labelled = probs.sum(-1) > 0  # [B, T]: only these rows enter the loss, so only they need logits
    logits = ttt_logits(head, tokens, feats, steps, rows=labelled if rows_only else None)
    if not rows_only:
        logits = [lg[labelled] for lg in logits]
    position = torch.arange(T, device=device).expand_as(labelled)[labelled]  # [N]
    probs, idx, focus = probs[labelled], idx[labelled], focus[labelled]  # [N, K], [N, K], [N, steps]
    total = 0.0
    acc = []
    for s, lg in enumerate(logits):
        keep = position >= s  # step s is defined from head position s on
        logp = torch.log_softmax(lg[keep].float(), dim=-1).gather(-1, idx[keep])
        loss_s = -(probs[keep] * logp).sum(-1)
        w = focus[keep, s]
        total = total + (decay ** s) * (loss_s * w).sum() / w.sum().clamp(min=1)
        hit = lg[keep].argmax(-1) == idx[keep, 0]
        acc.append(float(hit.sum()) / float(max(int(keep.sum()), 1)))
    return total, acc


# ---------------------------------------------------------------------- training loop
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


@torch.no_grad()
def evaluate_head(head: FeatureHead, records: Sequence[FeatureRecord], steps: int = 1, max_len: int = 2048) -> dict:
    """Teacher-forced top-1 agreement of the head's drafting step s with the target's argmax, over the
    generated positions of `records` (step 0 = the first drafted token after committed text)."""
    hits = [0] * steps
    totals = [0] * steps
    device = head.fc.weight.device
    for r in records:
        tokens, feats, T = make_batch([r], max_len)
        logits = ttt_logits(head, tokens.to(device), feats.to(device), steps)
        argmax = r.top_ids[1 : T + 1, 0]  # the target's choice of token p + 2
        start = max(r.prompt_len - 2, 0)
        for s, lg in enumerate(logits):
            lo = max(start, s)
            pred = head.to_target_ids(lg[0, lo:T].argmax(-1)).cpu()
            hits[s] += int((pred == argmax[lo:T]).sum())
            totals[s] += max(T - lo, 0)
    return {"agreement": [h / max(t, 1) for h, t in zip(hits, totals)], "tokens": totals[0], "sequences": len(records)}
