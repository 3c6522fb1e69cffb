"""Which candidate prompts the campaign keeps: near-duplicates go (normalised text, word n-gram
overlap), and so does anything near an evaluation prompt (a head is measured on prompts it never saw).

Two texts are near when their word n-gram sets overlap by at least `threshold` of the smaller set
(containment, so a prompt that quotes another whole is caught whatever its length), or, with
`verbatim`, when they share any run of that many words (a copied passage or sentence).
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict
from typing import Iterable, Optional, Sequence

_NON_WORD = re.compile(r"[^\w]+")


def normalise(text: str) -> str:
    """Lower case, NFKC, punctuation and underscores to spaces, single spaces."""
    return " ".join(_NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).replace("_", " ").split())


def shingles(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """The word n-grams of `words` (a text shorter than n is one shingle, itself)."""
    if len(words) <= n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class NearIndex:
    """Texts added so far, indexed by word n-grams; `near(text)` says whether one of them is near it."""

    def __init__(self, n: int = 4, threshold: float = 0.5, verbatim: Optional[int] = None):
        self.n, self.threshold, self.verbatim = n, threshold, verbatim
        self.sizes: list[int] = []
        self.postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self.exact: set[str] = set()
        self.runs: set[tuple[str, ...]] = set()

    def add(self, text: str) -> None:
        norm = normalise(text)
        words = norm.split()
        sh = shingles(words, self.n)
        doc = len(self.sizes)
        self.sizes.append(len(sh))
        for s in sh:
            self.postings[s].append(doc)
        self.exact.add(norm)
        if self.verbatim:
            self.runs |= {tuple(words[i : i + self.verbatim]) for i in range(len(words) - self.verbatim + 1)}

    def near(self, text: str) -> bool:
        norm = normalise(text)
        if norm in self.exact:
            return True
        words = norm.split()
        if self.verbatim and any(tuple(words[i : i + self.verbatim]) in self.runs
                                 for i in range(len(words) - self.verbatim + 1)):
            return True
        sh = shingles(words, self.n)
        shared: dict[int, int] = defaultdict(int)
        for s in sh:
            for doc in self.postings.get(s, ()):
                shared[doc] += 1
        return any(count >= self.threshold * min(len(sh), self.sizes[doc]) for doc, count in shared.items())


def evaluation_index(texts: Iterable[str]) -> NearIndex:
    """The evaluation prompts, for `near`: 3-gram containment 0.5, or any shared 8-word run."""
    index = NearIndex(n=3, threshold=0.5, verbatim=8)
    for t in texts:
        index.add(t)
    return index


def select(candidates: Sequence[str], evaluation: NearIndex, dedup_n: int = 4, dedup_threshold: float = 0.5) -> tuple[list[int], dict]:
    """Indices of the candidates kept, in order: the first of each near-duplicate group, none near an
    evaluation prompt. Also the counts of what was dropped and why."""
    seen = NearIndex(n=dedup_n, threshold=dedup_threshold)
    kept: list[int] = []
    dropped = {"evaluation": 0, "duplicate": 0}
    for i, text in enumerate(candidates):
        if evaluation.near(text):
            dropped["evaluation"] += 1
        elif seen.near(text):
            dropped["duplicate"] += 1
        else:
            seen.add(text)
            kept.append(i)
    return kept, dropped
