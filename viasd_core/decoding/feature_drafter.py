"""Draft from the target's own features: an EAGLE-3 head (eagle.FeatureHead) as a drafter.

The target (a FastModel) captures, in the passes it runs anyway, the states entering the head's
three feature layers (`FastModel.capture_features`): position p's are valid while p < target.seen.
Head position p reads the target's features at p and the token at p + 1, and predicts the token
at p + 2. So with n committed tokens (the target has run positions < n - 1; the last committed
token is its pending input) a proposal is:

    catch up   one head pass over positions [head.seen, n - 1): the target's features there and
               tokens [head.seen + 1, n); its last row predicts token n (draft 1)
    draft      gamma - 1 one-token head passes at positions n - 1, n, ...: the head's own output
               feature of the previous position and the token it just drafted

Only catch-up positions are the head's state for committed text; drafted positions are recomputed
from the target's features once verified (rollback keeps at most n - 1 positions).

viasd mode may commit tokens the target never ran (accept and slim tiers). There the features come
from the slim verifier, which ran them (its own residual stream at the same depths: an
approximation the acceptance rule absorbs, since every proposal is still verified or routed as
usual). When neither model has run a position yet, the drafter proposes nothing and the engine
takes a plain step, which runs the target over it.
"""

from __future__ import annotations

import torch

from viasd_core.decoding.drafters import ChainDrafter
from viasd_core.decoding.eagle import FeatureHead
from viasd_core.decoding.model import FastModel


class FeatureDrafter(ChainDrafter):
    name = "feature"

    def __init__(self, head: FeatureHead, target: FastModel, vocab_size: int | None = None):
        vocab_size = vocab_size or target.shape.vocab_size
        vocab_map = None
        if head.draft_vocab_size != head.vocab_size or bool(head.d2t.any()):
            vocab_map = head.to_target_ids(torch.arange(head.draft_vocab_size, device=head.d2t.device)).to(target.device)
        super().__init__(vocab_size, head.draft_vocab_size, vocab_map)
        self.head = head
        self.target = target
        self.slim: FastModel | None = None
        self.fed = 0  # head positions computed from a verifier's features (its state for committed text)
        target.capture_features(head.feature_layers)
        # Draft columns whose target id the target may not emit (a masked vocabulary) are never proposed.
        limit = target.vocab_limit
        ids = vocab_map if vocab_map is not None else torch.arange(self.limit, device=target.device)
        self.blocked = (ids >= limit) if limit is not None and bool((ids >= limit).any()) else None

    def link_slim(self, slim: FastModel | None) -> None:
        """Use `slim`'s features where the target has not run (viasd's accept and slim tiers)."""
        self.slim = slim
        if slim is not None:
            slim.capture_features(self.head.feature_layers)

    def compile(self) -> bool:
        return self.head.compile()  # its 1-token drafting step (CUDA graphs on CUDA)

    @property
    def compiled(self) -> bool:
        return self.head.compiled

    def warm_up(self) -> float:
        seconds = self.head.warm_up()
        self.fed = 0  # the warm-up emptied the head's cache
        return seconds

    def reset(self) -> None:
        self.head.reset()
        self.fed = 0

    def rollback(self, n: int) -> None:
        """The first n tokens are right: head position p reads token p + 1, so positions < n - 1 stay."""
        self.fed = min(self.fed, max(n - 1, 0))
        self.head.rollback(self.fed)

    def ensure_capacity(self, max_len: int) -> None:
        if self.head.max_len < max_len + 1:
            self.head.allocate(max_len + 1)
            self.fed = 0

    def _features(self, start: int, end: int) -> torch.Tensor | None:
        """Verifier features of positions [start, end): the target's, else the slim's; None if neither ran them."""
        t = self.target
        if end <= t.seen:
            return t.cache.features[start:end]
        s = self.slim
        if s is None or s.cache.features is None or end > s.seen:
            return None
        mid = max(start, min(t.seen, end))
        parts = [t.cache.features[start:mid]] if mid > start else []
        slim = s.cache.features[mid:end].to(t.dtype)  # a lower-precision slim view runs in bfloat16
        return torch.cat(parts + [slim]) if parts else slim

    def _mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None:
            logits[:, self.blocked] = float("-inf")
        return logits

    def _first_logits(self, ids: torch.Tensor, n: int) -> torch.Tensor | None:
        if n < 2:
            return None
        start = min(self.head.seen, n - 2)  # at least one position: its row predicts token n
        feats = self._features(start, n - 1)
        if feats is None:
            return None
        self.head.rollback(start)
        logits, hidden = self.head.forward(ids[start + 1 : n], feats, start, n_logits=1)
        self.fed = n - 1
        self._hidden = hidden[-1:].clone()
        return self._mask(logits)

    def _next_logits(self, ids: torch.Tensor, n: int, i: int) -> torch.Tensor:
        logits, hidden = self.head.forward(ids[n + i : n + i + 1], self._hidden, n - 1 + i, n_logits=1)
        self._hidden = hidden.clone()  # a compiled step's next call may overwrite its outputs (CUDA graphs)
        return self._mask(logits)
