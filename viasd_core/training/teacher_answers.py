"""The target's own answers to prompts: what both distillation kinds train on.

`build_dataset` runs batched generation with the target (left padding, KV cache); every `Record`
keeps the target's argmax at each generated position (the label), also when the continuation
itself was sampled. `choose_vocab` picks a draft's output vocabulary from those labels, and
`vocab_coverage` says how much of them it can express. The draft model (distill.py) and the
EAGLE-3 head (feature_distill.py) are both made from these.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from viasd_core import paths
from viasd_core.loading.models import Loaded, eos_ids, pad_token_id
from viasd_core.loading.prompts import encode

DEFAULT_PROMPTS = paths.package_data() / "distill_prompts.jsonl"


@dataclass
class Record:
    """One generated sequence: `input_ids` = prompt + continuation; `labels[i]` is the target's argmax
    after `input_ids[: prompt_len + i]` (so for greedy records labels == continuation)."""

    input_ids: torch.Tensor  # [prompt_len + n_new] int64
    prompt_len: int
    labels: torch.Tensor  # [n_new] int64
    category: str = ""

    def to_dict(self) -> dict:
        return {"input_ids": self.input_ids, "prompt_len": self.prompt_len, "labels": self.labels, "category": self.category}


@torch.no_grad()
def generate_batch(
    target,
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    compact: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """Left-padded batched decoding with a KV cache. Returns per prompt (continuation, target argmax labels).

    With `compact` a row that ended (end of sequence) leaves the batch and its KV cache, so the
    passes after it run only the rows still generating; without it every row runs to the end (the
    plain reference: greedy outputs are the same, tests/training/test_campaign.py).
    """
    device = target.get_input_embeddings().weight.device
    bsz, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    mask = torch.zeros((bsz, width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = target(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1, :]
    next_pos = position_ids[:, -1:] + 1
    tokens: list[list[int]] = [[] for _ in range(bsz)]
    labels: list[list[int]] = [[] for _ in range(bsz)]
    done = [False] * bsz
    rows = list(range(bsz))  # the prompt of each batch row
    for _ in range(max_new_tokens):
        logits = logits.float()
        argmax = logits.argmax(-1)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, -1).cpu()
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(device)
        else:
            chosen = argmax
        for b, (c, a) in enumerate(zip(chosen.tolist(), argmax.tolist())):
            i = rows[b]
            if not done[i]:
                tokens[i].append(c)
                labels[i].append(a)
                done[i] = c in eos_ids
        live = [b for b, i in enumerate(rows) if not done[i]]
        if not live:
            break
        if compact and len(live) < len(rows):
            keep = torch.tensor(live, device=device)
            past.batch_select_indices(keep)
            mask, next_pos, chosen = mask[keep], next_pos[keep], chosen[keep]
            rows = [rows[b] for b in live]
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=-1)
        out = target(input_ids=chosen[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = next_pos + 1
    return list(zip(tokens, labels))


def build_dataset(
    target: Loaded,
    prompts: Sequence[str],
    max_new_tokens: int = 128,
    batch_size: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
    categories: Optional[Sequence[str]] = None,
    max_prompt_tokens: int = 384,
    progress: Optional[Callable[[int, int], None]] = None,
) -> list[Record]:
    """Generate with the target on chat-templated `prompts` (greedy, or sampled at `temperature`);
    a prompt longer than `max_prompt_tokens` keeps its end.

    Prompts are processed in length-sorted batches (less padding); the result keeps prompt order.
    """
    eos = eos_ids(target)
    ids = [encode(target.tokenizer, p)[-max_prompt_tokens:] for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    gen = torch.Generator().manual_seed(seed)
    records: list[Optional[Record]] = [None] * len(ids)
    with _widened_once(target.model):
        _generate_batches(target, ids, order, records, max_new_tokens, batch_size, temperature, gen, eos, categories, progress)
    return records  # type: ignore[return-value]


def _widened_once(model):
    """For a packed (int8/int4) CPU target: every layer's weight widened once for the whole call, not
    at every pass. A pass of 17 rows or more (a batch of 32 decoding, a prefill) takes one dense
    product over the widened weight (packed_linear.PackedLinear), widened for each pass unless
    held; holding it gives the same numbers (the same widened weight) and measured 84.0 against
    64.7 answer tokens/s at batch 32 (docs/campaign.md). A float model: nothing to hold."""
    from viasd_core.runtime.packed_linear import widen_once
    from viasd_core.runtime.weight_formats import has_weight_format

    if not has_weight_format(model) or next(model.parameters()).device.type != "cpu":
        return contextlib.nullcontext()
    return widen_once([model], model.dtype)


def _generate_batches(target, ids, order, records, max_new_tokens, batch_size, temperature, gen, eos, categories,
                      progress) -> None:
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        outs = generate_batch(target.model, [ids[i] for i in chunk], max_new_tokens, eos, pad_token_id(target), temperature, gen)
        for i, (toks, labs) in zip(chunk, outs):
            records[i] = Record(
                input_ids=torch.tensor(ids[i] + toks, dtype=torch.long),
                prompt_len=len(ids[i]),
                labels=torch.tensor(labs, dtype=torch.long),
                category=categories[i] if categories else "",
            )
        if progress:
            progress(min(start + batch_size, len(order)), len(order))


def choose_vocab(records: Iterable[Record], size: int, always: Iterable[int] = (), fill_low_ids: bool = True) -> torch.Tensor:
    """The `size` target ids most frequent among the labels (ties by id), plus `always`; sorted by id.

    When the labels hold fewer than `size` distinct ids and `fill_low_ids` is set, the rest are the
    lowest ids not yet chosen: in a BPE vocabulary ids follow merge order, a frequency prior from
    the tokenizer's own corpus (on SmolLM2 this lifts Spec-Bench coverage from 0.84 to 0.89 at 8k).
    """
    counts: dict[int, int] = {}
    for r in records:
        for t in r.labels.tolist():
            counts[t] = counts.get(t, 0) + 1
    keep = list(dict.fromkeys(int(t) for t in always))
    chosen = set(keep)
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        if t not in chosen:
            keep.append(t)
            chosen.add(t)
    t = 0
    while fill_low_ids and len(keep) < size:
        if t not in chosen:
            keep.append(t)
            chosen.add(t)
        t += 1
    return torch.tensor(sorted(keep[:size]), dtype=torch.long)


def vocab_coverage(records: Iterable[Record], vocab_map: torch.Tensor) -> float:
    """Fraction of label tokens that the draft vocabulary can express (an upper bound on agreement)."""
    inside = torch.zeros(int(vocab_map.max()) + 1, dtype=torch.bool)
    inside[vocab_map] = True
    hit = total = 0
    for r in records:
        lab = r.labels
        ok = (lab < inside.numel()) & inside[lab.clamp(max=inside.numel() - 1)]
        hit, total = hit + int(ok.sum()), total + lab.numel()
    return hit / max(total, 1)
