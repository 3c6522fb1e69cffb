"""Drafts that remember (docs/drafts.md): proposals from counted suffix indexes (suffix_index.py)
over the current conversation and over every earlier request of this process, prompts and answers.

Two indexes, as SuffixDecoding keeps a per-request tree and a global one: `conversation` holds the
committed tokens of the current conversation only (rebuilt when its history is rewritten, emptied by
`reset`); `history` holds every committed token this drafter has seen, the current conversation's
included, and survives `reset` (a new request), so text that earlier requests produced is proposed
again. Each proposal is the walk, of the two, with the larger expected accepted length
(`Walk.expected`). Only committed tokens are indexed: the host copy the engine passes
(`host_tokens`), never a draft. `forget` empties both (a benchmark's runs must not see each other).
"""

from __future__ import annotations

import torch

from viasd_core.speculation.drafters import Drafter, Proposal, lookup_proposal
from viasd_core.speculation.sampling import Sampler, SamplingParams
from viasd_core.speculation.steps import common_prefix
from viasd_core.speculation.suffix_index import SuffixIndex, Walk

# Bounds: a 4096-token conversation makes at most 4096 x 7 contexts (orders 2..8); the history keeps
# the 2^17 contexts updated last, about 40 MB of Python objects at most.
CONVERSATION_ENTRIES = 1 << 15
HISTORY_ENTRIES = 1 << 17


class SuffixDrafter(Drafter):
    """Model-free drafts from what followed the current context before, here or in earlier requests."""

    name = "suffix"
    estimates = True  # Walk.expected is a frequency estimate: a hybrid compares it with its model's keep

    def __init__(self, max_order: int = 8, min_order: int = 2, min_prob: float = 0.1, min_expected: float = 1.0,
                 conversation_entries: int = CONVERSATION_ENTRIES, history_entries: int = HISTORY_ENTRIES):
        self.conversation = SuffixIndex(max_order, min_order, conversation_entries)
        self.history = SuffixIndex(max_order, min_order, history_entries)
        self.min_prob = min_prob  # a walk stops before its frequencies' product falls below this
        self.min_expected = min_expected  # alone: propose only walks expected to keep this many tokens
        self.reset()

    def reset(self) -> None:
        self.conversation.clear()
        self.tokens: list[int] = []  # the conversation's indexed tokens (a copy)
        self.check = False  # a rollback went below them: compare before indexing on

    def forget(self) -> None:
        self.reset()
        self.history.clear()

    def rollback(self, n: int) -> None:
        if n < len(self.tokens):  # the next context may rewrite what is indexed (a new prompt)
            self.check = True

    def prefill(self, ids: torch.Tensor, n: int) -> None:
        """Index the prompt inside the timed prefill (one read of its ids)."""
        self._update(ids[:n].tolist())

    def _update(self, host_tokens: list[int]) -> None:
        start = len(self.tokens)
        if self.check:
            self.check = False
            start = common_prefix(self.tokens, host_tokens)
        if start < len(self.tokens):  # rewritten from `start`: the conversation index is rebuilt
            self.conversation.clear()
            self.conversation.add(host_tokens)
            self.tokens = self.tokens[:start]
        else:
            self.conversation.add(host_tokens, start)
        self.history.add(host_tokens, start)  # what it held before `start` was committed text too
        self.tokens.extend(host_tokens[len(self.tokens):])

    def match(self, host_tokens: list[int], gamma: int) -> Walk:
        """The longer-expected walk of the two indexes after the committed tokens (up to gamma tokens)."""
        self._update(host_tokens)
        here = self.conversation.walk(host_tokens, gamma, self.min_prob)
        before = self.history.walk(host_tokens, gamma, self.min_prob)
        return here if here.expected >= before.expected else before

    def propose(self, ids: torch.Tensor, n: int, gamma: int, params: SamplingParams, sampler: Sampler, host_tokens=None,
                stop_below: float = 0.0) -> Proposal:
        walk = self.match(host_tokens, gamma)
        return lookup_proposal(ids, n, walk.tokens if walk.expected >= self.min_expected else [], self.name)
