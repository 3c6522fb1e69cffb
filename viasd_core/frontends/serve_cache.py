"""Which cached positions a server request may re-use: only those a fresh server computes alike.

A position's K/V depends on the pass that computed it, not only on the tokens: a 1-token decode
pass, a verify block of up to 16 rows, a catch-up of more than 16 (viasd's target after tiers it
did not run) and a prompt's prefill (passes of more than 16 positions, in chunks of 256 from
the pass's start) run other kernels and round differently. A server that kept every position
of the previous request's tokens would answer a request with numbers that depend on what the
earlier requests were (their mode, their length, their answer), so an `sd` answer could differ
from the same request on a fresh server.

The rule, exact by construction. A fresh server prefills a prompt of n tokens as one pass over
positions [0, n - 1), which runs chunks [0, 256), [256, 512), ... each computed exactly as a
pass of its own positions (FastModel._chunks, tested bit for bit). So a model keeps a cached
prefix of K positions only where

- K is a multiple of 256, no more than the tokens the cache and the new prompt share;
- every one of those positions was written by a whole 256-position chunk of a prompt prefill
  that itself started on a chunk boundary (inductively, from 0), and that chunk ended more than
  16 positions before that prefill's end, so no later pass of that request (re-fed positions,
  decode steps) wrote into it; and
- the new request's own prefill then runs more than 16 positions from K (K + 16 < n - 1), so it
  is an eager chunked pass starting at K: never a compiled or row-by-row short pass, never a
  re-fed position below K. Its chunks are then exactly the fresh prefill's chunks from K on.

Each model (the target, the slim verifier, a draft model) is tracked on its own: one that did
not run in a request (the slim under `sd`) keeps what it had, one that ran prefilled from its own
boundary. A drafter whose cache is not indexed by token position (the EAGLE-3 head) is reset
before a request that keeps anything. If anything other than this server ran a model since the
last request (its pass count moved), that model keeps nothing. A server with several KV slots
(serve_slots.py) keeps one such bookkeeping per slot: passes run on another slot's caches are
not counted against this one's (`resume`).

Cost: in a growing conversation the re-used part is the previous prompt's whole chunks; its last
partial chunk and the previous answer are prefilled again (they were computed by passes a fresh
prefill does not make).
"""

from __future__ import annotations

from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.hybrid_drafter import HybridDrafter
from viasd_core.speculation.engine import Engine
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.model_pass import PREFILL_CHUNK
from viasd_core.runtime.pass_widths import PASS_WIDTHS
from viasd_core.speculation.steps import common_prefix

SHORT = PASS_WIDTHS[-1]  # passes of up to this many positions run other kernels (compiled, by row)


def prefill_boundary(n_prompt: int) -> int:
    """The largest multiple of PREFILL_CHUNK, B, with B + SHORT < n_prompt - 1 (0 when none): the
    positions below B of a prompt's prefill lie in whole chunks that no later pass rewrites, and a
    prefill from B runs more than SHORT positions."""
    end = n_prompt - 1  # the positions a prefill runs (the last prompt token starts the decode)
    return max(0, (end - SHORT - 1) // PREFILL_CHUNK * PREFILL_CHUNK)


def reusable(tokens: list[int], prompt_ids: list[int], exact: int) -> int:
    """How many leading positions a cache holding `tokens`, of which the first `exact` are exact,
    may keep for `prompt_ids`: whole chunks of the common prefix below prefill_boundary."""
    keep = min(common_prefix(tokens, prompt_ids), prefill_boundary(len(prompt_ids)), exact)
    return keep // PREFILL_CHUNK * PREFILL_CHUNK


class PrefixReuse:
    """The exact-reuse bookkeeping of one engine (see the module's docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._exact: dict[int, tuple[FastModel, int, int]] = {}  # id(model) -> (model, exact prefix, its passes then)
        self._passes: dict[int, int] = {}

    def _models(self) -> list[FastModel]:
        """The models indexed by token position: the target, the slim verifier, a draft model."""
        eng = self.engine
        models = [eng.target] + ([eng.slim] if eng.slim is not None else [])
        d = eng.drafter
        inner = d.model_drafter if isinstance(d, HybridDrafter) else d
        if isinstance(inner, ModelDrafter):
            models.append(inner.model)
        return models

    def exact_prefix(self, model: FastModel) -> int:
        """How many leading cached positions of `model` a fresh server would compute alike."""
        got = self._exact.get(id(model))
        if got is None or got[0] is not model or got[2] != model.passes:
            return 0
        return min(got[1], model.seen)

    def before(self, prompt_ids: list[int]) -> int:
        """Roll every cache back to what may be re-used for `prompt_ids`; returns the target's part."""
        eng = self.engine
        models = self._models()
        kept = {}
        for m in models:
            k = reusable(eng.tokens, prompt_ids, self.exact_prefix(m))
            m.rollback(k)
            kept[id(m)] = k
        target_keep = kept[id(eng.target)]
        # The engine re-uses the common prefix of its committed tokens: cut them where the target's
        # exact part ends, so its own rollback keeps no more.
        eng.tokens = eng.tokens[:target_keep]
        d = eng.drafter
        if d is not None:
            if target_keep and any(id(m) not in kept for m in d.fast_models()):
                d.reset()  # its cache is not indexed by token position: start it afresh
            else:
                d.rollback(target_keep)
        self._passes = {id(m): m.passes for m in models}
        self._exact = {id(m): (m, kept[id(m)], m.passes) for m in models}
        return target_keep

    def after(self, prompt_ids: list[int]) -> None:
        """After the request: a model that ran prefilled from its kept boundary, so the prompt's
        whole chunks below prefill_boundary are exact now; one that did not run keeps its part."""
        boundary = prefill_boundary(len(prompt_ids))
        exact = {}
        for m in self._models():
            before = self._passes.get(id(m))
            got = self._exact.get(id(m))
            if before is None or got is None or got[0] is not m:
                continue  # attached meanwhile: nothing of it is known exact
            exact[id(m)] = (m, boundary if m.passes != before else got[1], m.passes)
        self._exact = exact

    def resume(self, elsewhere: dict[int, int]) -> None:
        """`elsewhere[id(model)]` passes of a model ran on other caches (a server's other slots,
        serve_slots.py) while this bookkeeping's cache was put aside: they left it alone, so they
        do not count as the model having run outside the server."""
        self._passes = {k: n + elsewhere.get(k, 0) for k, n in self._passes.items()}
        self._exact = {k: (m, keep, n + elsewhere.get(k, 0)) for k, (m, keep, n) in self._exact.items()}

    def forget(self) -> None:
        self._exact = {}
        self._passes = {}
