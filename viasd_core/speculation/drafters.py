"""Proposers of draft blocks, behind one contract (`Drafter`): a small draft model, prompt lookup
(n-gram, model-free), or elsewhere a model with a lookup beside it (hybrid_drafter.py), an EAGLE-3 head reading
the target's features (feature_drafter.py) and a counted suffix index that remembers earlier
requests (suffix_drafter.py). loading/drafter_factory.py builds the one a session asks for.

A drafter writes its proposed tokens into the engine's token buffer at [n, n + g) and returns
them with the distribution each was sampled from (None when the proposal is deterministic,
which the acceptance rule treats as a one-hot distribution).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from viasd_core.runtime.model import FastModel
from viasd_core.speculation.sampling import Sampler, SamplingParams, penalize, prefix_length, presence, process_logits
from viasd_core.speculation.suffix_index import Walk
from viasd_core.runtime.token_tree import TokenTree
from viasd_core.speculation.tree import TreeShape


@dataclass
class Proposal:
    tokens: torch.Tensor  # [g] int64, also written to ids[n:n + g]
    probs: torch.Tensor | None  # [g, V] float32 draft distribution, or None (greedy / deterministic)
    reads: int = 0  # device-to-host reads the drafter made (the confidence stop rule on the host)
    # [] int64 on the device, or None: how many of the g tokens are proposals (the confidence stop
    # decided on the device; positions from it on are drafted but not proposed). None: all g.
    limit: torch.Tensor | None = None
    source: str | None = None  # who proposed, for the statistics (None: the drafter itself, by its name)


def lookup_proposal(ids: torch.Tensor, n: int, tokens: list[int], source: str) -> Proposal:
    """A deterministic proposal of host tokens (a lookup's), written into ids[n:]."""
    if tokens:
        ids[n : n + len(tokens)] = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)
    return Proposal(tokens=ids[n : n + len(tokens)], probs=None, source=source)


class Drafter(ABC):
    """What the engine asks of every drafter (vLLM's proposer interface, for one sequence).

    Positions and token counts refer to the engine's token buffer `ids`: with n tokens committed,
    a proposal goes to ids[n : n + g]. `rollback(n)` has one meaning everywhere in the engine (a
    FastModel's too): the first n tokens of the buffer are committed and right; forget whatever
    depends on a later one. A drafter whose state lags behind catches up in its next proposal.
    """

    name: str = "drafter"

    @abstractmethod
    def propose(self, ids: torch.Tensor, n: int, gamma: int, params: SamplingParams, sampler: Sampler,
                host_tokens: list[int] | None = None, stop_below: float = 0.0) -> Proposal:
        """Draft up to `gamma` tokens into ids[n:] (fewer, or none, is allowed). `host_tokens` is the
        host copy of ids[:n]; `stop_below` > 0 asks for the confidence stop rule (ChainDrafter)."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """The first n tokens are committed and right: drop state that depends on any later one."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the conversation (a new one starts). What a drafter learned from earlier requests
        may stay (the suffix index's history): `forget` drops that too."""

    def forget(self) -> None:
        """Forget everything, earlier requests included (a benchmark's runs must not see each other)."""
        self.reset()

    def ensure_capacity(self, max_len: int) -> None:
        """Hold state for `max_len` positions (the engine's context); allocated once."""

    @property
    def tree_source(self) -> str:
        """Who grows this drafter's token trees, for the statistics."""
        return self.name

    def prefill(self, ids: torch.Tensor, n: int) -> None:
        """Catch up on the prompt ids[:n] once the verifiers have run it, inside the engine's timed
        prefill: the first proposal then costs what any other does (the draft policy measures it).
        Default: nothing (the next proposal catches up)."""

    def fast_models(self) -> list[FastModel]:
        """The FastModels the drafter runs (the engine sizes them and checks their passes with its own)."""
        return []

    def weights_identity(self) -> str | None:
        """A short fingerprint of the weights this drafter proposes with (None: it has none, or does
        not say). Measurements cached per machine that depend on the draft's acceptance key on it,
        so a head retrained or replaced under the same name is measured again."""
        return None

    def compile(self) -> bool:
        """torch.compile what the drafter runs per drafted token; False when nothing could be."""
        return any([m.compile() for m in self.fast_models()])

    def set_short_rows(self, rows) -> None:
        """Short float32 passes take the products `rows` (a short_products.ShortRows) gives them."""
        for m in self.fast_models():
            m.short_rows = rows

    @property
    def compiled(self) -> bool:
        return any(m.compiled for m in self.fast_models())

    def warm_up(self) -> float:
        """Compile now the graphs drafting meets (1-token steps, 2-token catch-ups); seconds taken."""
        return sum(m.warm_up(max_width=1) for m in self.fast_models())

    def link_slim(self, slim: FastModel | None) -> None:
        """What the drafter needs from the verifiers beyond the target it was built with: the slim
        verifier, attached or replaced (a feature drafter reads its features where the target has
        not run). Called by the engine whenever its slim verifier changes."""

    supports_tree: bool = False  # whether `propose_tree` can grow token trees (tree.py)

    def propose_tree(self, ids: torch.Tensor, n: int, shape: TreeShape, params: SamplingParams, sampler: Sampler,
                     host_tokens: list[int] | None = None) -> TokenTree | None:
        """A token tree below the last committed token (tree.py), or None: draft a chain this step."""
        return None

    def warm_up_tree(self, shape: TreeShape) -> float:
        """Compile now what growing trees of `shape` runs; seconds taken."""
        return 0.0


class ChainDrafter(Drafter):
    """Drafts a block token by token from logits over its own (possibly reduced) vocabulary.

    Subclasses give `_first_logits` (catch up on the committed context, logits of the next token;
    None when they cannot draft now) and `_next_logits` (feed drafted token i). Greedy proposals
    are deterministic; sampled ones carry their distributions, placed in the target's vocabulary.
    """

    def __init__(self, vocab_size: int, draft_width: int, vocab_map: torch.Tensor | None = None):
        self.vocab_size = vocab_size  # the target's logit width: draft probs are returned in it
        self.vocab_map = vocab_map  # [Vd] int64: draft output index -> target token id (reduced-vocab drafts)
        # Draft output columns used: all of a reduced head; else those both models have (their row
        # counts may differ, e.g. Qwen2.5-7B 152064 vs 0.5B 151936), target ids equal to the column.
        self.limit = vocab_map.shape[0] if vocab_map is not None else min(vocab_size, draft_width)

    def _to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab_map is None else self.vocab_map[idx]

    def _widen(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """Draft probabilities [1, limit] -> [1, target width], zero at the ids the draft cannot propose."""
        full = torch.zeros(1, self.vocab_size, dtype=draft_probs.dtype, device=draft_probs.device)
        if self.vocab_map is not None:
            full[:, self.vocab_map] = draft_probs
        else:
            full[:, : self.limit] = draft_probs
        return full

    def _seen(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """[Vd] bool over the draft's columns: which occur in the committed context ids[:n]."""
        seen = presence(ids[:n], self.vocab_size)
        return seen[self.vocab_map] if self.vocab_map is not None else seen[: self.limit].clone()

    def prefill(self, ids: torch.Tensor, n: int) -> None:
        """Catch up on all but the last prompt position, as a proposal after n - 1 tokens would: the
        first proposal then runs that one position for its logits, as any later proposal does."""
        if n > 2:
            self._first_logits(ids, n - 1)

    @abstractmethod
    def _first_logits(self, ids: torch.Tensor, n: int) -> torch.Tensor | None:
        """Catch up on the committed context; logits [1, width] of token n (None: cannot draft now)."""

    @abstractmethod
    def _next_logits(self, ids: torch.Tensor, n: int, i: int) -> torch.Tensor:
        """Feed drafted token i (at ids[n + i]); logits [1, width] of the next one."""

    # Where the confidence stop is decided: None = by the device (on the host where reading a value
    # costs nothing, a CPU; on the device elsewhere, where a read waits for the device).
    stop_on_device: bool | None = None

    def propose(self, ids: torch.Tensor, n: int, gamma: int, params: SamplingParams, sampler: Sampler, host_tokens=None,
                stop_below: float = 0.0) -> Proposal:
        """Draft up to `gamma` tokens into ids[n:]. `stop_below` > 0: the confidence stop rule. The
        block ends before the first position at which the draft's own estimate that the block is
        accepted (the product of its top probabilities so far) falls below `stop_below`; it may end
        empty. Decided on the host, the drafting stops there (one host read per drafted token);
        decided on the device, all `gamma` tokens are drafted and `Proposal.limit` says how many
        are proposals (no host read). Whether a position is proposed depends on its distribution,
        never on the token drawn from it, so speculative sampling stays exact either way."""
        logits = self._first_logits(ids, n)
        if logits is None:
            return Proposal(tokens=ids[n:n], probs=None)
        on_device = self.stop_on_device if self.stop_on_device is not None else ids.device.type != "cpu"
        logits = logits[:, : self.limit]  # [1, Vd]
        seen = self._seen(ids, n) if params.penalized else None  # [Vd]: the repetition penalty's context
        probs_rows = []
        reads = 0
        sure = None  # [1] the draft's probability that the block so far is all accepted
        confident = []  # [1] bool per drafted position (decided on the device)
        for i in range(gamma):
            logits = penalize(logits, seen, params.repetition_penalty)
            if params.greedy:
                idx = logits.argmax(-1)
                conf = torch.softmax(logits, -1).amax(-1) if stop_below > 0 else None
            else:
                draft_probs = process_logits(logits, params)  # [1, Vd]
                idx = sampler.categorical(draft_probs)
                conf = draft_probs.amax(-1) if stop_below > 0 else None
            if conf is not None:
                sure = conf if sure is None else sure * conf
                if on_device:
                    confident.append(sure >= stop_below)
                else:
                    reads += 1
                    if float(sure) < stop_below:
                        gamma = i
                        break
            if not params.greedy:
                if self.vocab_map is not None or self.limit != self.vocab_size:
                    draft_probs = self._widen(draft_probs)
                probs_rows.append(draft_probs)
            ids[n + i] = self._to_target(idx)[0]
            if seen is not None:
                seen[idx] = True  # the next position's context holds this token too
            if i + 1 < gamma:
                logits = self._next_logits(ids, n, i)[:, : self.limit]
        probs = torch.cat(probs_rows) if probs_rows else None
        limit = prefix_length(torch.cat(confident)) if confident else None  # sure only falls: a prefix
        return Proposal(tokens=ids[n : n + gamma], probs=probs, reads=reads, limit=limit)


class ModelDrafter(ChainDrafter):
    """Autoregressive proposals from a small model with its own static KV cache."""

    name = "model"

    def __init__(self, model: FastModel, vocab_size: int, vocab_map: torch.Tensor | None = None):
        super().__init__(vocab_size, model.shape.vocab_size, vocab_map)
        self.model = model

    def reset(self) -> None:
        self.model.reset()

    def rollback(self, n: int) -> None:
        self.model.rollback(n)  # draft position p reads token p: n positions

    def ensure_capacity(self, max_len: int) -> None:
        self.model.allocate(max_len)

    def fast_models(self) -> list[FastModel]:
        return [self.model]

    def _first_logits(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        return self.model.extend(ids, n, 1)

    def _next_logits(self, ids: torch.Tensor, n: int, i: int) -> torch.Tensor:
        return self.model.forward(ids[n + i : n + i + 1], n + i, 1)


class NgramDrafter(Drafter):
    """Prompt lookup: propose what followed the latest earlier occurrence of the current suffix.

    Keeps an incremental index {n-gram -> latest end position} over the committed tokens, so a
    proposal costs O(max_ngram) dictionary look-ups, not a scan of the context.
    """

    name = "ngram"
    # Its estimate of a match is the copy's length (prompt lookup assumes the copy goes on), not a
    # frequency: a hybrid compares it with its min_match only (HybridDrafter).
    estimates = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    def reset(self) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # end positions below this are indexed
        self.tokens: list[int] = []

    def rollback(self, n: int) -> None:
        if n < self.indexed:  # history rewritten (a new conversation): rebuild lazily
            self.reset()

    def _update(self, host_tokens: list[int]) -> None:
        if host_tokens[: self.indexed] != self.tokens[: self.indexed]:
            self.reset()
        self.tokens = host_tokens
        # Index every end position except the last (the suffix must not match itself).
        for end in range(self.indexed, len(host_tokens) - 1):
            for k in range(self.min_ngram, self.max_ngram + 1):
                if end - k + 1 >= 0:
                    self.index[tuple(host_tokens[end - k + 1 : end + 1])] = end
        self.indexed = max(self.indexed, len(host_tokens) - 1)

    def match(self, host_tokens: list[int], gamma: int) -> Walk:
        """What followed the latest earlier occurrence of the longest suffix found (up to gamma tokens)."""
        self._update(host_tokens)
        L = len(host_tokens)
        for k in range(self.max_ngram, self.min_ngram - 1, -1):
            if L < k:
                continue
            end = self.index.get(tuple(host_tokens[L - k :]))
            if end is not None:
                found = host_tokens[end + 1 : end + 1 + gamma]
                return Walk(found, [1.0] * len(found))
        return Walk([], [])

    def propose(self, ids: torch.Tensor, n: int, gamma: int, params: SamplingParams, sampler: Sampler, host_tokens=None,
                stop_below: float = 0.0) -> Proposal:
        return lookup_proposal(ids, n, self.match(host_tokens, gamma).tokens, self.name)
