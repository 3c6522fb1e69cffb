"""A stand-in for CUDA graph trees' output lifetimes that runs anywhere: every compiled call
poisons the outputs of the compiled calls before it.

The rule it stands in for. On CUDA, torch.compile(mode="reduce-overhead") runs the compiled passes
as CUDA graph trees (torch/_inductor/cudagraph_trees.py, read on torch 2.13). Every graph of a
device allocates its outputs in one memory pool. Each call of a torch.compile'd function from
outside begins a new generation (on entry, dynamo's `install_generation_tagging_init` bumps
`GenerationTracker.generation`); with no backward pending, a new generation ends the previous one,
whose outputs' memory goes back to the pool (`try_end_curr_execution`; after a warm-up or a
recording, `dealloc_current_path_weakrefs`, which also marks those storages so that a later access
raises "Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
run"). The next replay writes its own outputs there, so a tensor kept from an earlier compiled call
silently holds the later call's numbers, or raises. Not invalidated: outputs whose storage is a
static input (a parameter or buffer: an output aliasing one is not pool memory), and anything the
caller copied (a `.clone()`, or a new tensor an eager op made from the output) before the next
compiled call.

The stand-in is at least as strict: while it is on, each call of a `guard`ed function first
overwrites the memory of the outputs of ALL earlier guarded calls that any tensor still reads (any
model, any pass width; graph trees keep a parent's outputs alive for its child graphs within one
generation, the stand-in never does): the whole storage, as graph trees reuse it, so views and
slices of an output see it too. Floating point becomes NaN, integers the dtype's minimum (an index
fails loudly), booleans their negation. Outputs sharing storage with the guarded function's
`static` tensors are spared, as on CUDA. A read of a stale output then computes with poison
instead of numbers that merely survived on the CPU.

In viasd, `FastModel.compile` guards the one compiled pass, with its cache's buffers as static: the
KV caches and the captured features (`cache.features`) are written in place inside the graph
(inputs mutated, never outputs), so they outlive every call. The pass's only output is its logits.
The EAGLE head is not compiled (it runs eagerly: feature_drafter.py).

On: `VIASD_CHECK_GRAPH_OUTPUTS=1` in the environment (a whole run with `--compile on`, on a CPU as
well as on CUDA), or `with checking():` in a test. Off, a guarded call costs one look-up of the flag.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch.utils._pytree import tree_leaves

ENV = "VIASD_CHECK_GRAPH_OUTPUTS"

_forced: bool | None = None  # set by checking(); None: the environment decides
_live: list[tuple[weakref.ref, torch.dtype]] = []  # storages written by the latest guarded call, with their dtype
checked = 0  # guarded calls made while the check was on (tests read these two: the check really ran)
poisoned = 0  # outputs poisoned (still alive at a later guarded call)


def active() -> bool:
    """Whether guarded calls poison earlier outputs now."""
    return _forced if _forced is not None else os.environ.get(ENV) == "1"


@contextmanager
def checking(on: bool = True):
    """Turn the check on (or off) inside the block, whatever the environment says."""
    global _forced
    before = _forced
    _forced = on
    try:
        yield
    finally:
        _forced = before
        _live.clear()


def _poison(t: torch.Tensor) -> None:
    """Overwrite t in place with values no computation should use: NaN, the integer minimum, or NOT."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def invalidate_outputs() -> None:
    """Poison the memory of every earlier guarded call's outputs still in use (what the next call
    would overwrite): the whole storage, so every view of an output reads the poison."""
    global poisoned
    for ref, dtype in _live:
        storage = ref()
        if storage is not None:  # a tensor still reads it (the output itself or a view of it)
            with torch.inference_mode():  # outputs made under inference mode are inference tensors
                _poison(torch.empty(0, dtype=dtype, device=storage.device).set_(storage))
            poisoned += 1
    _live.clear()


def guard(fn: Callable, static: Iterable[torch.Tensor] = ()) -> Callable:
    """`fn` (a compiled function) whose calls, while the check is `active()`, poison the outputs of
    every earlier guarded call; its outputs sharing storage with a `static` tensor are never poisoned."""
    static_storage = {t.untyped_storage().data_ptr() for t in static}

    def call(*args, **kwargs):
        global checked
        if not active():
            return fn(*args, **kwargs)
        checked += 1
        invalidate_outputs()
        out = fn(*args, **kwargs)
        seen = set(static_storage)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())  # outputs sharing a storage: poisoned once
                _live.append((weakref.ref(t.untyped_storage()), t.dtype))
        return out

    call.__wrapped__ = fn
    return call
