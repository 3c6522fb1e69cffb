"""A running request parked: the used part of its KV slot copied out, so the slot can serve another.

When every KV slot is held and a request with a better turn waits (serve_turns.py), the server
parks the slot holder with the worst turn: the valid positions of every cache its slot holds
(each model's K/V and captured features below its `seen`, an EAGLE head's), its committed tokens
and their token buffer are copied out to tensors of exactly that length, and its host state (the
n-gram index, the head's last feature, the exact-reuse bookkeeping) is kept by reference. The
slot is then free. Taking the request up again copies those tensors back into the first positions
of any free slot's caches, bit for bit: the positions at and past `seen` are stale in every cache
by contract (attention.CachedPositions; each pass writes them before it reads them), so the
request resumes exactly as if it had never left (tested: the same tokens, every mode).

Memory: a parked request costs its used positions only, not a whole slot (a slot is sized for
the whole context); the pool bounds what all parked requests hold together (SlotPool.park_limit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from viasd_core.runtime.attention import LayerCache


def _layers(cache) -> list[LayerCache]:
    return [cache] if isinstance(cache, LayerCache) else list(cache.layers)


def used_bytes(cache, n: int) -> int:
    """What the first `n` positions of `cache` (a StaticCache or a LayerCache) take, K/V and features."""
    total = 0
    for c in _layers(cache):
        _, heads, _, dim = c.k.shape
        total += 2 * heads * n * dim * c.k.element_size()
    features = getattr(cache, "features", None)
    if features is not None:
        total += n * features[0].numel() * features.element_size()
    return total


class CompactCache:
    """The first `n` positions of a cache, copied out (K/V [1, heads, n, dim] per layer; features [n, F])."""

    def __init__(self, cache, n: int):
        self.n = n
        self.kv = [(c.k[:, :, :n].clone(), c.v[:, :, :n].clone()) for c in _layers(cache)]
        features = getattr(cache, "features", None)
        self.features = features[:n].clone() if features is not None else None
        self.nbytes = used_bytes(cache, n)

    def copy_into(self, cache) -> None:
        """Write the kept positions into the first `n` positions of `cache` (shaped like the original)."""
        n = self.n
        layers = _layers(cache)
        if len(layers) != len(self.kv):
            raise ValueError(f"a parked cache of {len(self.kv)} layers cannot go into one of {len(layers)}")
        for (k, v), c in zip(self.kv, layers):
            c.k[:, :, :n].copy_(k)
            c.v[:, :, :n].copy_(v)
        if self.features is not None:
            if cache.features is None:  # captured features were switched on after this slot was made
                rows = cache.key_pos.shape[0]
                cache.register_buffer("features", self.features.new_zeros(rows, *self.features.shape[1:]),
                                      persistent=False)
            cache.features[:n].copy_(self.features)


@dataclass(eq=False)
class Parked:
    """A request's slot state while it holds no slot (SlotPool.park, SlotPool.restore)."""

    values: dict[int, tuple]  # id(part) -> its attributes as the slot held them, caches as CompactCache
    tokens: list[int]  # the committed tokens
    ids: torch.Tensor  # [len(tokens)] their device copy
    passes: dict[int, int]  # id(model) -> its pass count when parked (serve_cache.PrefixReuse.resume)
    reuse: object  # the slot's serve_cache.PrefixReuse, which follows the request
    drafter: str | None  # the drafter whose state follows these tokens
    exact: int
    nbytes: int  # what the copies take
