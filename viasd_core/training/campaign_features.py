"""Stage 3 of the campaign: the target's features and soft labels for every stored sequence, kept on disk.

Features are stored, not recomputed per training batch: a teacher pass costs more per position than
a training step of the head (the target's 30 layers and 49k-row output against one layer and an 8k
output), and training reads every sequence several times. At ~2M positions x 1728 x 2 bytes
(bfloat16) they take ~7 GB in the work folder, never committed; the token ids they come from are.

`run_feature_stage` teacher-forces each answer shard (eagle_data.teacher_pass) into a feature shard
folder of the same name (campaign_store.FeatureShard). `CampaignRecords` reads them back as
eagle_data.FeatureRecords, one sequence at a time (memory-mapped), for training and evaluation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from viasd_core.training import campaign_store as store
from viasd_core.training.eagle_data import FeatureRecord, teacher_pass


def run_feature_stage(model, layers: Sequence[int], shards: Sequence[Path], features: Path, batch_size: int,
                      log: Callable[[str], None]) -> None:
    """Teacher-force every sequence shard in `shards` whose feature folder (same name, under `features`)
    is missing."""
    for k, path in enumerate(shards):
        out = features / path.stem
        if out.exists():
            continue
        seqs = store.SequenceShard.load(path)
        t0 = time.perf_counter()
        recs = teacher_pass(model, [(s.tolist(), p, "") for s, p in zip(seqs.sequences, seqs.prompt_lens)], layers,
                            batch_size=batch_size, progress=lambda i, n: log(f"features {path.stem}: {i}/{n} sequences"))
        store.save_feature_shard(out, torch.cat([r.features for r in recs]), torch.cat([r.top_ids for r in recs]),
                                 torch.cat([r.top_logp for r in recs]))
        dt = time.perf_counter() - t0
        log(f"features {path.stem} ({k + 1}/{len(shards)}): {seqs.positions} positions in {dt:.0f} s "
            f"({seqs.positions / dt:.0f}/s)")


class CampaignRecords(Sequence[FeatureRecord]):
    """The sequences of some shards as FeatureRecords, read on access (features memory-mapped).

    `keep(prompt_index)` picks sequences (e.g. training vs held-out prompts); `categories[i]` names
    prompt i's category. `focus` (optional, per shard name) gives per-sequence loss weights [L, S].
    """

    def __init__(self, shards: Sequence[Path], features: Path, keep: Callable[[int], bool] = lambda i: True,
                 categories: Optional[Sequence[str]] = None,
                 focus: Optional[Callable[[str, int, int], Optional[torch.Tensor]]] = None):
        self.seqs = [store.SequenceShard.load(p) for p in shards]
        self.names = [p.stem for p in shards]
        self.features = features
        self._open: dict[int, store.FeatureShard] = {}
        self.offsets = [s.offsets() for s in self.seqs]
        self.index = [(k, i) for k, s in enumerate(self.seqs) for i, pi in enumerate(s.prompt_index) if keep(pi)]
        self.categories = categories
        self.focus = focus

    def __len__(self) -> int:
        return len(self.index)

    def _shard(self, k: int) -> store.FeatureShard:
        if k not in self._open:
            self._open[k] = store.FeatureShard(self.features / self.names[k])
        return self._open[k]

    def tokens(self, n: int) -> tuple[np.ndarray, int]:
        """Sequence n's token ids and prompt length (no feature read)."""
        k, i = self.index[n]
        return self.seqs[k].sequences[i], self.seqs[k].prompt_lens[i]

    def labels(self, n: int) -> torch.Tensor:
        """The target's argmax at sequence n's generated positions (read from the top-k ids only)."""
        k, i = self.index[n]
        lo, hi = self.offsets[k][i], self.offsets[k][i + 1]
        start = max(self.seqs[k].prompt_lens[i] - 1, 0)
        return torch.from_numpy(np.array(self._shard(k).top_ids[lo + start : hi - 1, 0])).long()

    def lengths(self) -> list[int]:
        """Each selected sequence's token count (no feature read)."""
        return [len(self.tokens(n)[0]) for n in range(len(self))]

    def positions(self) -> tuple[int, int]:
        """(all positions, generated positions) of the selected sequences."""
        toks = [self.tokens(n) for n in range(len(self))]
        return sum(len(t) for t, _ in toks), sum(len(t) - p for t, p in toks)

    def __getitem__(self, n: int) -> FeatureRecord:  # type: ignore[override]
        k, i = self.index[n]
        lo, hi = self.offsets[k][i], self.offsets[k][i + 1]
        feats, top_ids, top_logp = self._shard(k).rows(int(lo), int(hi))
        pi = self.seqs[k].prompt_index[i]
        rec = FeatureRecord(torch.from_numpy(self.seqs[k].sequences[i]).long(), feats, top_ids, top_logp,
                            self.seqs[k].prompt_lens[i], self.categories[pi] if self.categories else "")
        if self.focus is not None:
            rec.focus = self.focus(self.names[k], i, int(hi - lo))
        return rec
