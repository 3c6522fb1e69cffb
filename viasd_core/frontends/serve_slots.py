"""Several conversations cached at once: a bounded set of KV slots over the server's one engine.

A slot is everything a conversation leaves in the engine: each model's KV cache (the target's,
the slim verifier's, a draft model's, an EAGLE head's; a StaticCache holds the target's captured
features too), how many positions of each are valid, the committed tokens and their device
buffer, the drafters' host state (the n-gram index) and the exact-reuse bookkeeping of
serve_cache.PrefixReuse. One slot is live at a time: `activate` puts the live slot's objects
aside and installs another's, by reference (no copy: a swap costs a few attribute writes
whatever the context's length). Compiled passes read the cache through the model's attribute,
so a swapped cache is read without compiling again (measured on CPU: no recompilation).

The first slot is the engine's own caches; the others are allocated on first use, each as large
as the first (the whole context), sharing the RoPE tables. A drafter kind this module does not
know is reset whenever its slot comes back (correct: a drafter's state only changes which tokens
are proposed, and it catches up from the committed tokens; only slower). A hybrid drafter's own
statistics (which of its proposers wins) are shared by the slots.

Which slot a request gets (`choose`): among the slots no running request holds, the one whose
cache it may keep most of (serve_cache.reusable: whole prefill chunks of the common prefix,
within what that slot computed exactly); on a tie, or when none keeps anything, a slot never used
while there is one, else the least recently used. A slot's cache survives every request that
runs on another slot.

Parking (serve_parking.py): `park` copies a held slot's used positions out and leaves the slot
blank (its buffers kept, its conversation gone), `restore` copies a parked request into a free
slot and makes it live. What all parked requests hold together is bounded by `park_limit` (by
default one slot's bytes; `can_park` says whether one more fits). `spare` is the free slot a
parked request goes back into: a new one while fewer than `count` exist, else a blank one, else
the least recently used.
"""

from __future__ import annotations

import torch

from viasd_core.runtime.attention import LayerCache
from viasd_core.speculation.drafters import Drafter, ModelDrafter, NgramDrafter
from viasd_core.speculation.hybrid_drafter import HybridDrafter
from viasd_core.speculation.engine import Engine
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.runtime.kv_cache import StaticCache
from viasd_core.runtime.model import FastModel
from viasd_core.devices import free_memory_bytes
from viasd_core.frontends.serve_cache import PrefixReuse, reusable
from viasd_core.frontends.serve_parking import CompactCache, Parked, used_bytes

DEFAULT_SLOTS = 4  # --slots' default where memory allows (llama-server's and the issue's load test's)
MEMORY_SHARE = 0.5  # the extra slots may take at most this share of the memory free after loading

_MODEL = ("cache", "seen")  # a FastModel's state (its C kernels are bound to its cache: cache.kernels)
_HEAD = ("cache", "seen")  # an EAGLE head's
_HOST = {NgramDrafter: ("index", "indexed", "tokens"), FeatureDrafter: ("fed", "_hidden")}


def _fresh(cache):
    """An empty cache shaped like `cache` (a StaticCache or a LayerCache), sharing its RoPE tables."""
    if isinstance(cache, LayerCache):
        k = cache.k
        return LayerCache(k.shape[1], k.shape[2], k.shape[3], k.dtype, k.device)
    new = StaticCache.__new__(StaticCache)
    torch.nn.Module.__init__(new)
    new.layers = torch.nn.ModuleList(_fresh(c) for c in cache.layers)
    for name, buf in cache._buffers.items():  # the tables and positions shared, the features its own
        new.register_buffer(name, torch.zeros_like(buf) if name == "features" and buf is not None else buf,
                            persistent=False)
    new.tables = cache.tables
    return new


def _own_bytes(cache) -> int:
    """The bytes a slot's copy of `cache` allocates (its K/V and features; not the shared tables)."""
    layers = [cache] if isinstance(cache, LayerCache) else list(cache.layers)
    total = sum(t.numel() * t.element_size() for c in layers for t in (c.k, c.v))
    features = getattr(cache, "features", None)
    return total + (features.numel() * features.element_size() if features is not None else 0)


class Slot:
    """One conversation's state, live in the engine or put aside."""

    def __init__(self, index: int, engine: Engine):
        self.index = index
        self.state: dict[int, tuple] | None = None  # id(part) -> its attributes, while put aside; None: blank
        self.buffers: dict[int, object] = {}  # id(part) -> its cache object, while blank after parking (kept for re-use)
        self.tokens: list[int] = []
        self.ids: torch.Tensor | None = None
        self.reuse = PrefixReuse(engine)
        self.passes: dict[int, int] = {}  # id(model) -> its pass count when this slot was put aside
        self.exact = 0  # the target's exact prefix when put aside (serve_cache.PrefixReuse.exact_prefix)
        self.drafter: str | None = None  # the drafter whose state follows this slot's tokens
        self.used = 0  # the pool's clock at its last use (LRU)
        self.holder = None  # the running request that holds it, if any


class SlotPool:
    """Up to `count` slots over `engine` (None: `default_count`), whose drafters (every one a
    request may attach) are `drafters`."""

    def __init__(self, engine: Engine, drafters: list[Drafter], count: int | None = None):
        if count is not None and count < 1:
            raise ValueError(f"a server needs at least one KV slot, got {count}")
        self.engine = engine
        self.models: list[FastModel] = []  # every FastModel whose cache a slot holds
        self.parts: list[tuple[object, tuple[str, ...]]] = []  # (object, the attributes a slot holds of it)
        self.resets: list[Drafter] = []  # drafters of a kind this module does not know: reset on each swap
        self.drafters = list({id(d): d for d in drafters if d is not None}.values())
        for m in [engine.target] + ([engine.slim] if engine.slim is not None else []):
            self._add_model(m)
        for d in self.drafters:
            self._add_drafter(d)
        self.count = count if count is not None else self.default_count()
        first = Slot(0, engine)  # live: the engine's own caches
        self.slots = [first]
        self.live: Slot | None = first  # None right after parking the live slot
        self._clock = 0
        self.park_limit = self.slot_bytes()  # bytes all parked requests may hold together (0: no parking)
        self.parked_bytes = 0

    def _add_model(self, m: FastModel) -> None:
        if all(m is not x for x in self.models):
            self.models.append(m)
            self.parts.append((m, _MODEL))

    def _add_drafter(self, d: Drafter) -> None:
        for m in d.fast_models():
            self._add_model(m)
        if isinstance(d, HybridDrafter):
            for part in (d.model_drafter, getattr(d, "lookup", None) or getattr(d, "ngram", None)):
                if part is not None:
                    self._add_drafter(part)
        elif isinstance(d, FeatureDrafter):
            self.parts += [(d, _HOST[FeatureDrafter]), (d.head, _HEAD)]
        elif type(d) in _HOST:
            self.parts.append((d, _HOST[type(d)]))
        elif not isinstance(d, ModelDrafter):
            self.resets.append(d)

    # ------------------------------------------------------------------ memory
    def slot_bytes(self) -> int:
        """What one more slot allocates: every cache a slot holds, and its token buffer."""
        caches = [getattr(obj, "cache") for obj, attrs in self.parts if "cache" in attrs]
        ids = self.engine.ids
        return sum(_own_bytes(c) for c in caches) + ids.numel() * ids.element_size()

    def default_count(self) -> int:
        """--slots' default: DEFAULT_SLOTS, fewer where the slots beyond the first (allocated on
        first use) and the parking room (park_limit: one slot's bytes) would take more than
        MEMORY_SHARE of the device's free memory now; at least 1."""
        fit = int(MEMORY_SHARE * free_memory_bytes(self.engine.device) // max(self.slot_bytes(), 1))
        return 1 + max(0, min(DEFAULT_SLOTS - 1, fit - 1))

    def describe(self) -> str:
        """For the server's start line: '4 KV slots of 12.5 MiB'."""
        return f"{self.count} KV slot{'s' * (self.count != 1)} of {self.slot_bytes() / 2**20:.1f} MiB"

    # ------------------------------------------------------------------ choosing
    def _tokens(self, slot: Slot) -> list[int]:
        return self.engine.tokens if slot is self.live else slot.tokens

    def reusable(self, slot: Slot, prompt_ids: list[int]) -> int:
        """How many of the prompt's positions `slot`'s target cache may keep."""
        if slot is self.live:
            return reusable(self.engine.tokens, prompt_ids, slot.reuse.exact_prefix(self.engine.target))
        return reusable(slot.tokens, prompt_ids, slot.exact)

    def choose(self, prompt_ids: list[int]) -> Slot | None:
        """The free slot for `prompt_ids` (see the module's docstring), a new one while fewer than
        `count` exist; None when running requests hold every slot."""
        free = [s for s in self.slots if s.holder is None]
        best = max(free, key=lambda s: (self.reusable(s, prompt_ids), s.used == 0, -s.used), default=None)
        if (best is None or self.reusable(best, prompt_ids) == 0) and len(self.slots) < self.count:
            best = Slot(len(self.slots), self.engine)
            self.slots.append(best)
        return best

    def spare(self) -> Slot | None:
        """A free slot for a parked request (whose cache nothing re-uses): a new one while fewer than
        `count` exist, else a blank one, else the least recently used; None when every slot is held."""
        free = [s for s in self.slots if s.holder is None]
        if len(self.slots) < self.count:
            slot = Slot(len(self.slots), self.engine)
            self.slots.append(slot)
            return slot
        return min(free, key=lambda s: (len(self._tokens(s)) > 0, s.used), default=None)

    def hold(self, slot: Slot, holder) -> None:
        self._clock += 1
        slot.holder, slot.used = holder, self._clock

    def release(self, slot: Slot) -> None:
        slot.holder = None

    def held(self) -> int:
        """How many slots a running request holds (0 to `count`)."""
        return sum(s.holder is not None for s in self.slots)

    # ------------------------------------------------------------------ swapping
    def _values(self, slot: Slot) -> dict[int, tuple]:
        """`slot`'s part attributes: the live objects' when it is live, else what it put aside."""
        if slot is self.live:
            return {id(obj): tuple(getattr(obj, a, None) for a in attrs) for obj, attrs in self.parts}
        return slot.state

    def _put_aside(self) -> None:
        """Save the live slot's objects into it (by reference); no slot is live after."""
        eng, out = self.engine, self.live
        out.state = self._values(out)
        out.tokens, out.ids = eng.tokens, eng.ids
        out.passes = {id(m): m.passes for m in self.models}
        out.exact = out.reuse.exact_prefix(eng.target)
        self.live = None

    def activate(self, slot: Slot) -> None:
        """Make `slot` the engine's live state, putting the live one aside."""
        if slot is self.live:
            return
        eng = self.engine
        if self.live is not None:
            self._put_aside()
        if not slot.state:  # blank: empty caches (its buffers after parking, else new ones)
            for obj, attrs in self.parts:
                if "cache" in attrs:
                    kept = slot.buffers.get(id(obj))
                    obj.cache = kept if kept is not None else _fresh(obj.cache)
                    obj.seen = 0
                    if kept is None and isinstance(obj, FastModel):
                        obj.bind_kernels()  # the C kernels bound to the new cache's buffers
            for d in self.drafters:
                d.reset()
            if slot.ids is None:
                slot.ids = torch.zeros_like(eng.ids)
            slot.tokens = []
        else:
            for obj, attrs in self.parts:
                for a, value in zip(attrs, slot.state[id(obj)]):
                    setattr(obj, a, value)
            for d in self.resets:
                d.reset()
            slot.reuse.resume({id(m): m.passes - slot.passes.get(id(m), m.passes) for m in self.models})
        slot.state, slot.buffers = None, {}
        eng.tokens, eng.ids = slot.tokens, slot.ids
        self.live = slot

    # ------------------------------------------------------------------ parking
    def park_bytes(self, slot: Slot) -> int:
        """What parking `slot` would copy out: every cache's valid positions and the token buffer's."""
        values = self._values(slot)
        total = len(self._tokens(slot)) * self.engine.ids.element_size()
        for obj, attrs in self.parts:
            if "cache" in attrs:
                got = dict(zip(attrs, values[id(obj)]))
                total += used_bytes(got["cache"], got["seen"])
        return total

    def can_park(self, slot: Slot, freed: int = 0) -> bool:
        """Whether parking `slot` keeps the parked bytes within park_limit, once `freed` bytes (a
        parked request going back into a slot) have left."""
        return self.parked_bytes - freed + self.park_bytes(slot) <= self.park_limit

    def park(self, slot: Slot) -> Parked:
        """Copy `slot`'s used state out and leave it blank and free (its buffers kept for re-use)."""
        if slot is self.live:
            self._put_aside()
        values, copies = {}, 0
        for obj, attrs in self.parts:
            got = list(slot.state[id(obj)])
            if "cache" in attrs:
                at = attrs.index("cache")
                slot.buffers[id(obj)] = got[at]
                got[at] = CompactCache(got[at], got[attrs.index("seen")])
                copies += got[at].nbytes
            values[id(obj)] = tuple(got)
        n = len(slot.tokens)
        parked = Parked(values, slot.tokens, slot.ids[:n].clone(), slot.passes, slot.reuse, slot.drafter, slot.exact,
                        copies + n * slot.ids.element_size())
        slot.state, slot.tokens, slot.passes, slot.exact = None, [], {}, 0
        slot.reuse, slot.drafter, slot.holder = PrefixReuse(self.engine), None, None
        self.parked_bytes += parked.nbytes
        return parked

    def restore(self, parked: Parked, slot: Slot) -> None:
        """Copy `parked` into the free `slot` (whose own conversation is dropped) and make it live."""
        if slot.holder is not None:
            raise ValueError(f"slot {slot.index} is held: a parked request goes back into a free slot")
        if slot is self.live:
            self._put_aside()
        if slot.state:  # an idle conversation: dropped, its caches kept as buffers
            for obj, attrs in self.parts:
                if "cache" in attrs:
                    slot.buffers[id(obj)] = slot.state[id(obj)][attrs.index("cache")]
            slot.state = None
        self.activate(slot)  # blank: its buffers (or new caches), the drafters reset
        for obj, attrs in self.parts:
            for a, value in zip(attrs, parked.values[id(obj)]):
                if a == "cache":
                    value.copy_into(obj.cache)
                else:
                    setattr(obj, a, value)
        eng = self.engine
        eng.ids[: len(parked.tokens)].copy_(parked.ids)
        eng.tokens = slot.tokens = parked.tokens
        slot.reuse, slot.drafter, slot.exact = parked.reuse, parked.drafter, parked.exact
        slot.reuse.resume({id(m): m.passes - parked.passes.get(id(m), m.passes) for m in self.models})
        self.parked_bytes -= parked.nbytes
