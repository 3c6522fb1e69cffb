"""Which way the int8/int4 short-pass products run on a CPU that builds two, timed once and cached.

On a CPU with AVX-512 BF16, viasd_kernels' packed products (kernels/cpu_packed_mm.c) can multiply
each widened weight by the rows through BF16 pair dot products (`vdpbf16ps`) or, as every other
class does, through float32 FMA over weights widened to float32 (the portable way). Which is faster
depends on the core: on the 2-core Xeon of 2026-12-02 (Sapphire Rapids, AVX-512 BF16 + AMX) the
two took the same time for a 1-token pass and the portable way 15-20% less for 2-16 rows, which a
verify pass pays: `sd` 1.01x -> 1.07x `ar` (docs/experiments/xeon-classes-20261202.md). Both ways
are row-invariant and each is tested bit for bit against its reference. The loader hands the choice
to the runtime as it loads an int format on a CPU (loading/models.py -> runtime/cpu_kernels.py
`use_packed_way`), read once a process, before the layers bind their products, so every pass of a
session runs one way and `sd` stays exact. Their numbers differ only where a group's float32 sums
round (rarely: 1 of 13 prompts' 64 greedy tokens differed, at the last token), as another CPU's would.

The measurement times one int4 layer product (3072 x 576, 16 weights in turn) and one int8 head
product (16384 x 576) at 1 and 4 rows through each way: the portable way is chosen when it takes at
most MARGIN of the BF16 way's time. Where one way builds there is nothing to time. `VIASD_PACKED_WAY`
(`bf16` or `portable`) pins the choice (a benchmark's A/B, the test suite's determinism); where the
BF16 way does not build, `bf16` cannot be had and the portable way runs. Machine-wide, like
bf16.py's verdict: it depends on no model and no setting (profile.py's MACHINE_WIDE).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import torch
from viasd_kernels import cpu_packed_mm

from viasd_core.errors import UsageError
from viasd_core.machine.record import Decision

ENV = "VIASD_PACKED_WAY"
PINS = ("bf16", "portable")
MARGIN = 0.95  # the portable way must take at most this fraction of the BF16 way's time
FIELDS = ("portable", "bf16_ms", "portable_ms", "only", "pinned")


def _folder():
    from viasd_core.runtime import cpu_kernels  # the kernels' build folder (looked up at call time)

    return cpu_kernels.folder()


def pinned() -> str | None:
    """VIASD_PACKED_WAY's value ('bf16' or 'portable'), None where unset; UsageError for another."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in PINS:
        raise UsageError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(PINS)}")
    return value


def products_seconds(portable: bool, rounds: int = 5) -> float:
    """The best of `rounds` timings of the products the module's doc names, through one way."""
    g = torch.Generator().manual_seed(0)
    build = _folder()
    layers = [cpu_packed_mm.bind_int4(torch.randint(0, 256, (3072, 288), generator=g, dtype=torch.uint8), 32,
                                      (torch.randn(18, 3072, 2, generator=g) * 0.01).to(torch.bfloat16), 64,
                                      build_dir=build, portable=portable) for _ in range(16)]
    head = cpu_packed_mm.bind_int8(torch.randint(-127, 128, (16384, 576), generator=g, dtype=torch.int8),
                                   (torch.rand(16384, generator=g) * 0.01).to(torch.bfloat16), build_dir=build,
                                   portable=portable)
    rows = {m: torch.randn(m, 576, generator=g).to(torch.bfloat16) for m in (1, 4)}
    best = float("inf")
    for _ in range(rounds + 1):  # the first one warms up
        t0 = time.perf_counter()
        for x in rows.values():
            for layer in layers:
                layer(x)
            head(x)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(device: torch.device, seconds: Callable[[bool], float] = products_seconds,
            ways: Callable[[], tuple[str, ...]] | None = None) -> dict:
    """{"portable": the portable way chosen, and either "bf16_ms"/"portable_ms" (both timed) or
    "only" (the one way that builds here)} on `device` (a CPU)."""
    built = (ways or (lambda: cpu_packed_mm.ways(_folder())))()
    if len(built) < 2:
        return {"portable": True, "only": built[0] if built else "none"}
    bf16, portable = seconds(False), seconds(True)
    return {"portable": portable <= MARGIN * bf16, "bf16_ms": round(bf16 * 1e3, 3),
            "portable_ms": round(portable * 1e3, 3)}


DECISION = Decision("packed-way", "", 1, measure,
                    "which way the int8/int4 short-pass products run where a CPU builds two (AVX-512 BF16 pair "
                    "dot products or float32 FMA over widened weights): the faster, timed")


def verdict(device: torch.device | str = "cpu", refresh: bool = False) -> dict:
    """The choice for `device`: pinned by VIASD_PACKED_WAY, else the cached measurement (measured
    and stored when there is none, or `refresh`). Off a CPU: {"portable": False} (no such products)."""
    device = torch.device(device)
    if device.type != "cpu":
        return {"portable": False}
    pin = pinned()
    if pin is not None:
        built = cpu_packed_mm.ways(_folder())
        if len(built) < 2:  # one way builds here: the pin changes nothing, and the verdict says so
            return {"portable": True, "only": built[0] if built else "none", "pinned": f"{ENV}={pin}"}
        return {"portable": pin == "portable", "pinned": f"{ENV}={pin}"}
    result = DECISION.stored_or_measured(device, {}, _from_json, lambda: measure(device), refresh)
    portable.cache_clear()  # the per-process answer follows a refresh
    return result


def shown(result: dict) -> tuple[str, str]:
    """(value, reason) for doctor's picture."""
    value = "portable" if result["portable"] else "bf16"
    if "only" in result:
        unpinned = f"; {result['pinned']} changes nothing" if "pinned" in result else ""
        return value, f"the one way that builds here ({result['only']}){unpinned}"
    if "pinned" in result:
        return value, f"pinned by {result['pinned']}"
    if "bf16_ms" in result:
        return value, f"{result['bf16_ms']:g} ms BF16 pair dot products, {result['portable_ms']:g} ms portable"
    return value, "not a CPU"


def _from_json(data: dict) -> dict:
    if not isinstance(data.get("portable"), bool):
        raise TypeError("no verdict")
    return {k: data[k] for k in FIELDS if k in data}


@functools.lru_cache(maxsize=None)
def portable() -> bool:
    """Whether this process binds the portable way where the BF16 way builds too (read once a
    process; the loader hands it over)."""
    return bool(verdict("cpu")["portable"])
