"""How good a draft model is: its top-1 agreement with the target (teacher-forced, on the target's
own answers) and its decode cost relative to the target's (c in the speed-up formula)."""

from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

import torch

from viasd_core.training.teacher_answers import Record


@torch.no_grad()
def evaluate_agreement(draft, records: Sequence[Record], vocab_map: Optional[torch.Tensor] = None) -> dict:
    """Teacher-forced top-1 agreement on the target's continuations (`records` from `build_dataset`).

    The draft runs once over prompt + continuation and its argmax, mapped through vocab_map, is
    compared with the target's argmax at every generated position.
    Returns {"agreement", "tokens", "prompts", "by_category"}.
    """
    vocab_map = vocab_map if vocab_map is not None else draft.viasd_vocab_map
    device = draft.get_input_embeddings().weight.device
    vocab_map = vocab_map.to(device)
    hits: dict[str, list[int]] = {}
    for r in records:
        n = r.labels.numel()
        if n == 0:
            continue
        logits = draft(input_ids=r.input_ids[None, : r.prompt_len + n - 1].to(device), use_cache=False).logits[0]
        pred = vocab_map[logits[r.prompt_len - 1 : r.prompt_len - 1 + n].argmax(-1)].cpu()
        h = hits.setdefault(r.category, [0, 0])
        h[0] += int((pred == r.labels).sum())
        h[1] += n
    hit, total = sum(h[0] for h in hits.values()), sum(h[1] for h in hits.values())
    return {
        "agreement": hit / max(total, 1),
        "tokens": total,
        "prompts": len(records),
        "by_category": {c: h[0] / max(h[1], 1) for c, h in sorted(hits.items())},
    }


@torch.no_grad()
def _decode_times_ms(model, prompt: torch.Tensor, steps: int, warmup: int) -> list[float]:
    out = model(input_ids=prompt, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1000)
    return times


def measure_cost(draft, target, prompt_len: int = 64, steps: int = 100, warmup: int = 10, repeats: int = 3, seed: int = 0) -> dict:
    """Per-token decode cost of draft vs target: batch 1, one token per forward with a KV cache.

    Both models decode from the same random prompt; the two are interleaved over `repeats`
    rounds so that load from other processes hits both alike. Returns median ms of each and the
    ratio draft/target (c in the speed-up formula).
    """
    device = target.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(seed)
    low = min(100, target.config.vocab_size // 2)
    prompt = torch.randint(low, target.config.vocab_size, (1, prompt_len), generator=gen).to(device)
    draft_ms: list[float] = []
    target_ms: list[float] = []
    for _ in range(repeats):
        target_ms += _decode_times_ms(target, prompt, steps, warmup)
        draft_ms += _decode_times_ms(draft, prompt, steps, warmup)
    d, t = statistics.median(draft_ms), statistics.median(target_ms)
    return {"draft_ms": d, "target_ms": t, "ratio": d / t, "steps": len(draft_ms), "threads": torch.get_num_threads()}
