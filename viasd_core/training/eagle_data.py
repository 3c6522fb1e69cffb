"""The data an EAGLE-3 head trains on: the target's own features and next-token distributions.

`teacher_pass`: ONE teacher-forced, batched target pass per batch of sequences gives, at every
position, the three layer states the head reads and the target's next-token distribution (its
top-k, as soft labels): thousands of labels per second, where label-by-label generation gives tens.
`FeatureRecord` holds one sequence's; `save_records` / `load_records` write and read them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from viasd_core.errors import UsageError

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
