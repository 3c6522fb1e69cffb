"""EAGLE-3's training-time test: the head's logits for every drafting step at all positions at once
(`ttt_logits`: `steps` drafting steps unrolled in parallel, step s feeding each position the head's
own output of step s - 1), the soft cross-entropy against the target's distribution (`ttt_loss`) and the
teacher-forced top-1 agreement per draft position (`evaluate_head`).

Label alignment: head position p reads the target's features at p and the token at p + 1, and
predicts the token at p + 2, whose target distribution is the one at target position p + 1.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from viasd_core.runtime import attention
from viasd_core.speculation.eagle import FeatureHead
from viasd_core.training.eagle_data import FeatureRecord


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
    Equal to drafting with `FeatureHead.forward` (tests/speculation/test_feature_drafter.py checks it).
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
