"""A bounded, counted n-gram index of token text: what followed each context of 2..8 tokens, and how
often (docs/drafts.md). In the spirit of llama.cpp's n-gram cache and SuffixDecoding (arXiv
2411.04975): a context of k tokens maps to the counts of the tokens seen after it, and a draft walks
the most frequent continuation, at each step from the longest context the index holds.

Bounded memory: at most `max_entries` contexts (least recently updated ones are dropped first) and
at most MAX_NEXT distinct next tokens per context (the least counted one makes room). Contexts are
keyed by their tuple's hash: a rare collision can only make a draft worse, never the output, which
the target verifies whatever the draft proposes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_NEXT = 8  # distinct next tokens kept per context


@dataclass
class Walk:
    """A proposed continuation and the index's own estimate of it."""

    tokens: list[int]
    probs: list[float]  # per token: its count over its context's total (the empirical frequency)

    @property
    def expected(self) -> float:
        """Expected accepted tokens if each is accepted with its frequency, given the ones before it:
        sum over i of prod_{j <= i} probs[j] (SuffixDecoding's score of a speculation path)."""
        total, sure = 0.0, 1.0
        for p in self.probs:
            sure *= p
            total += sure
        return total


class SuffixIndex:
    """Context (2..max_order tokens) -> {next token: count}, updated one committed token at a time."""

    def __init__(self, max_order: int = 8, min_order: int = 2, max_entries: int = 1 << 16):
        if not 1 <= min_order <= max_order:
            raise ValueError("need 1 <= min_order <= max_order")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_order = max_order
        self.min_order = min_order
        self.max_entries = max_entries
        self.table: OrderedDict[int, dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.table)

    def clear(self) -> None:
        self.table.clear()

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Count tokens[i] after each of its contexts, for every i >= start (the earlier ones are
        the context only: they were counted before)."""
        for i in range(max(start, self.min_order), len(tokens)):
            nxt = tokens[i]
            for k in range(self.min_order, min(self.max_order, i) + 1):
                self._count(hash(tuple(tokens[i - k : i])), nxt)

    def _count(self, key: int, nxt: int) -> None:
        table = self.table
        counts = table.get(key)
        if counts is None:
            if len(table) >= self.max_entries:
                table.popitem(last=False)  # the least recently updated context
            counts = table[key] = {}
        else:
            table.move_to_end(key)
        if nxt not in counts and len(counts) >= MAX_NEXT:
            del counts[min(counts, key=counts.__getitem__)]
        counts[nxt] = counts.get(nxt, 0) + 1

    def next_counts(self, context: list[int]) -> dict[int, int] | None:
        """The counts after the longest suffix of `context` the index holds (min_order tokens at
        least), or None."""
        for k in range(min(self.max_order, len(context)), self.min_order - 1, -1):
            counts = self.table.get(hash(tuple(context[len(context) - k :])))
            if counts:
                return counts
        return None

    def walk(self, context: list[int], limit: int, min_prob: float = 0.1) -> Walk:
        """Up to `limit` tokens after `context`: at each step the most frequent next token after the
        longest context held, until the product of their frequencies falls below `min_prob` (the
        token that would take it there is not proposed) or nothing follows."""
        tail = list(context[-self.max_order :])
        out = Walk([], [])
        sure = 1.0
        while len(out.tokens) < limit:
            counts = self.next_counts(tail)
            if counts is None:
                break
            token = max(counts, key=counts.__getitem__)
            p = counts[token] / sum(counts.values())
            if sure * p < min_prob:
                break
            sure *= p
            out.tokens.append(token)
            out.probs.append(p)
            tail = tail[1:] + [token] if len(tail) == self.max_order else tail + [token]
        return out
