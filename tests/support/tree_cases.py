"""A drafter that knows ar's continuation and hides it in a fixed token tree: the tree tests' oracle.
Each test file lays out its own tree (`propose_tree`); the chain side drafts nothing."""

from __future__ import annotations

from viasd_core.speculation.drafters import Drafter, Proposal


class FutureTrees(Drafter):
    """Knows ar's continuation `future` of a prompt of `start` tokens (subclasses place it in a tree)."""

    supports_tree = True

    def __init__(self, future: list[int], start: int, vocab: int):
        self.future, self.start, self.vocab = future, start, vocab

    def propose(self, ids, n, gamma, params, sampler, host_tokens=None, stop_below=0.0) -> Proposal:
        return Proposal(tokens=ids[n:n], probs=None)

    def rollback(self, n):
        pass

    def reset(self):
        pass
