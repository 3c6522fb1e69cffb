"""A model drafter with a lookup beside it (prompt lookup or the suffix index): whichever is
expected to have more of its block accepted drafts each step (docs/drafts.md)."""

from __future__ import annotations

import torch

from viasd_core.speculation.drafters import ChainDrafter, Drafter, NgramDrafter, Proposal, lookup_proposal
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.suffix_index import Walk
from viasd_core.runtime.token_tree import TokenTree
from viasd_core.speculation.tree import TreeShape


class HybridDrafter(Drafter):
    """A lookup (prompt lookup, or the suffix index) where the text repeats, the draft model otherwise.

    Each step the lookup proposes when the tokens it expects accepted (`Walk.expected`) reach
    `min_match`, and, for a lookup that estimates from frequencies (`estimates`: the suffix index),
    also what the model's own proposals have been keeping on average (a decayed mean, learned from
    the rollback after each of its proposals): by expected accepted length per step. The choice
    depends only on the committed context and earlier steps, so each proposal still comes from a
    well-defined distribution (one-hot for a lookup) and the acceptance rule stays exact. The model's
    cache simply lags while the lookup proposes, and catches up on its next call.
    """

    name = "hybrid"
    DECAY = 0.95  # weight of the past in the model's mean kept tokens, per proposal of the model

    def __init__(self, model_drafter: ChainDrafter, lookup: Drafter | None = None, min_match: int = 2):
        self.model_drafter = model_drafter
        self.lookup = lookup or NgramDrafter()
        self.min_match = min_match
        self._forget_model()

    def _forget_model(self) -> None:
        self.kept_sum = 0.0  # decayed sums over the model's proposals: tokens kept, proposals
        self.kept_count = 0.0
        self.pending: tuple[int, int] | None = None  # (position, tokens) of the model's last proposal

    @property
    def model_kept(self) -> float:
        """Drafted tokens the model's proposals kept on average (0 before any was verified)."""
        return self.kept_sum / self.kept_count if self.kept_count else 0.0

    def _lookup_wins(self, walk: Walk) -> bool:
        bar = max(self.min_match, self.model_kept) if self.lookup.estimates else self.min_match
        return len(walk.tokens) > 0 and walk.expected >= bar

    def reset(self) -> None:
        self.model_drafter.reset()
        self.lookup.reset()
        self.pending = None

    def forget(self) -> None:
        self.model_drafter.forget()
        self.lookup.forget()
        self._forget_model()

    def rollback(self, n: int) -> None:
        if self.pending is not None:  # the first rollback after a model proposal says what it kept
            start, drafted = self.pending
            self.pending = None
            self.kept_sum = self.DECAY * self.kept_sum + min(max(n - start, 0), drafted)
            self.kept_count = self.DECAY * self.kept_count + 1
        self.model_drafter.rollback(n)
        self.lookup.rollback(n)

    def weights_identity(self) -> str | None:
        return self.model_drafter.weights_identity()

    def ensure_capacity(self, max_len: int) -> None:
        self.model_drafter.ensure_capacity(max_len)

    def fast_models(self) -> list[FastModel]:
        return self.model_drafter.fast_models()

    def prefill(self, ids: torch.Tensor, n: int) -> None:
        self.model_drafter.prefill(ids, n)
        self.lookup.prefill(ids, n)

    def set_short_rows(self, rows) -> None:
        self.model_drafter.set_short_rows(rows)

    def compile(self) -> bool:
        return self.model_drafter.compile()

    @property
    def compiled(self) -> bool:
        return self.model_drafter.compiled

    def warm_up(self) -> float:
        return self.model_drafter.warm_up()

    def link_slim(self, slim: FastModel | None) -> None:
        self.model_drafter.link_slim(slim)

    @property
    def supports_tree(self) -> bool:
        return self.model_drafter.supports_tree

    @property
    def tree_source(self) -> str:
        return self.model_drafter.name

    def propose_tree(self, ids, n, shape, params, sampler, host_tokens=None) -> TokenTree | None:
        """The model's tree, unless the lookup proposes this step (None: the chain step asks it)."""
        if self._lookup_wins(self.lookup.match(host_tokens, shape.depth)):
            return None
        tree = self.model_drafter.propose_tree(ids, n, shape, params, sampler, host_tokens)
        if tree is not None:
            self.pending = (n, tree.max_depth)
        return tree

    def warm_up_tree(self, shape: TreeShape) -> float:
        return self.model_drafter.warm_up_tree(shape)

    def propose(self, ids, n, gamma, params, sampler, host_tokens=None, stop_below: float = 0.0) -> Proposal:
        walk = self.lookup.match(host_tokens, gamma)
        if self._lookup_wins(walk):
            return lookup_proposal(ids, n, walk.tokens, self.lookup.name)
        proposal = self.model_drafter.propose(ids, n, gamma, params, sampler, host_tokens, stop_below=stop_below)
        proposal.source = proposal.source or self.model_drafter.name
        if proposal.tokens.shape[0]:
            self.pending = (n, proposal.tokens.shape[0])
        return proposal
