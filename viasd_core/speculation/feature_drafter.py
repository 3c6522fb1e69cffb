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

import hashlib

import torch

from viasd_core.speculation.drafters import ChainDrafter
from viasd_core.speculation.eagle import FeatureHead
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.sampling import Sampler, SamplingParams, process_logits
from viasd_core.runtime.token_tree import TokenTree, region_mask
from viasd_core.speculation.tree import Candidates, TreeShape, select_tree

TREE_ROWS = 64  # head cache slots past the context for a tree's expanded rows ((depth - 1) * topk)


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
        self._identity: str | None = None
        target.capture_features(head.feature_layers)
        # Draft columns whose target id the target may not emit (a masked vocabulary) are never proposed.
        limit = target.vocab_limit
        ids = vocab_map if vocab_map is not None else torch.arange(self.limit, device=target.device)
        self.blocked = (ids >= limit) if limit is not None and bool((ids >= limit).any()) else None

    def weights_identity(self) -> str | None:
        """sha256 over every parameter of the head but the target's shared embedding, and the packed
        data of its int8/int4 products: its name, shape and about 4,096 evenly strided values
        (training moves them all; an 8B target's head is not read whole). Computed once."""
        if self._identity is None:
            digest = hashlib.sha256()
            packed = [(n, b) for n, b in self.head.named_buffers() if n.endswith((".qdata", ".scale"))]
            for name, p in sorted([*self.head.named_parameters(), *packed], key=lambda item: item[0]):
                if name.startswith("embed_tokens."):
                    continue
                flat = p.detach().reshape(-1)
                sample = flat[:: max(1, flat.numel() // 4096)].to("cpu", torch.float32).contiguous()
                digest.update(f"{name}{tuple(p.shape)}".encode())
                digest.update(sample.numpy().tobytes())
            self._identity = digest.hexdigest()[:16]
        return self._identity

    def link_slim(self, slim: FastModel | None) -> None:
        """Use `slim`'s features where the target has not run (viasd's accept and slim tiers)."""
        self.slim = slim
        if slim is not None:
            slim.capture_features(self.head.feature_layers)

    def compile(self) -> bool:
        return self.head.compile()  # its 1-token drafting step (CUDA graphs on CUDA)

    def set_short_rows(self, rows) -> None:
        super().set_short_rows(rows)
        self.head.short_rows = rows

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
        if self.head.max_len < max_len + 1 + TREE_ROWS:
            self.head.allocate(max_len + 1 + TREE_ROWS)
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

    # ------------------------------------------------------------------ token trees (tree.py)
    supports_tree = True

    def warm_up_tree(self, shape: TreeShape) -> float:
        seconds = self.head.warm_up_rows(shape.topk) if shape.depth > 1 else 0.0
        self.fed = 0
        return seconds

    def _log_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The draft's log-probabilities [K, Vd] that rank tree nodes (after temperature/top-k/top-p when sampling)."""
        logits = self._mask(logits[:, : self.limit])
        if params.greedy:
            return torch.log_softmax(logits.float(), -1)
        return process_logits(logits, params).clamp_min(1e-30).log()

    def propose_tree(self, ids: torch.Tensor, n: int, shape: TreeShape, params: SamplingParams, sampler: Sampler,
                     host_tokens=None) -> TokenTree | None:
        """EAGLE-2's dynamic tree: depth 1 holds the head's `topk` best tokens; each later depth expands
        the `topk` best nodes of the one before (cumulative log-probability) by their `topk` best
        children, all of a depth in one head pass; the `size` best nodes overall are kept.

        Head rows of expanded nodes sit at slots n - 1 + (depth - 1) * topk + i (past the head's
        committed positions, which stay as they are) and attend to the committed positions, their
        ancestors' rows and themselves. No host read: the tree's shape is static.
        """
        K, D = shape.topk, shape.depth
        if n - 1 + (D - 1) * K > self.head.max_len:
            return None
        logits = self._first_logits(ids, n)  # [1, Vd]; self._hidden: the root's feature [1, H]
        if logits is None:
            return None
        device = logits.device
        top = self._log_probs(logits, params).topk(K, -1)
        scores, tokens = top.values[0], self._to_target(top.indices[0])  # [K]
        cands = Candidates([tokens], [torch.full((K,), -1, device=device)], [scores],
                           [torch.ones(K, dtype=torch.long, device=device)])
        # the frontier: the nodes expanded at this depth (candidate index, token, score, feature, rows seen)
        f_index, f_tokens, f_scores = torch.arange(K, device=device), tokens, scores
        f_hidden = self._hidden.expand(K, -1)
        R = max(1, (D - 1) * K)
        f_sees = torch.zeros(K, R, dtype=torch.bool, device=device)
        key_slots = torch.arange(self.head.max_len, device=device)
        grown = K
        for d in range(1, D):
            own = torch.arange(K, device=device) + (d - 1) * K  # the frontier's row slots (relative)
            sees = f_sees.clone()
            sees[torch.arange(K, device=device), own] = True
            mask = region_mask(n - 1, sees, key_slots)  # [K, max_len]
            rope = torch.full((K,), n - 2 + d, device=device)
            logits, hidden = self.head.tree_rows(f_tokens, f_hidden, rope, n - 1 + own, mask)
            top = self._log_probs(logits, params).topk(K, -1)  # [K, K]
            child_scores = (f_scores[:, None] + top.values).flatten()  # [K * K]
            child_tokens = self._to_target(top.indices).flatten()
            cands.tokens.append(child_tokens)
            cands.parents.append(f_index.repeat_interleave(K))
            cands.scores.append(child_scores)
            cands.depths.append(torch.full((K * K,), d + 1, device=device))
            best = child_scores.topk(K).indices  # the next frontier
            parent_row = best // K
            f_index, f_tokens, f_scores = grown + best, child_tokens[best], child_scores[best]
            f_hidden, f_sees = hidden[parent_row], sees[parent_row]
            grown += K * K
        return select_tree(cands, shape.size, D)
