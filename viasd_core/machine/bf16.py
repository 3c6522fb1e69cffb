"""Whether bfloat16 matrix products pay on this machine, measured once and cached.

bfloat16 halves the bytes of a product's operands, and on a CPU with bfloat16 instructions
(AVX-512 BF16, AMX) its products run several times faster than float32 ones. A CPU without them
(AVX2 only) has no fast kernel for them: on a 2-core AMD EPYC a 1024 x 1152 by 1152 x 576 product
took 9 ms in float32 and 772 ms in bfloat16. Two places choose by this:

- a long prompt's prefill in the int8/int4 formats (packed_linear.PackedLinear: one dense product
  over the widened weight) computes in bfloat16 where it pays, else in float32 over the same
  weight values;
- training (training/shared.resolve_bf16) uses bfloat16 autocast where it pays.

On a GPU the answer is whether it supports bfloat16 at all. On a CPU one product of each kind is
timed (a few hundred ms at most, once) and the verdict cached per machine
(machine/record.py), so every later command reads it. The profile's machine-wide decision
(machine/profile.py): nothing it measures depends on a model or a setting.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch

from viasd_core.machine.record import Decision

MARGIN = 0.8  # bfloat16 must take at most this fraction of float32's time
FIELDS = ("pays", "bf16_ms", "fp32_ms")


def product_seconds(dtype: torch.dtype, device: torch.device, rows: int = 256, rounds: int = 3) -> float:
    """The best of `rounds` timings of one prefill-sized product (rows x 1152 by 1152 x 576)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, 1152, generator=g).to(device, dtype)
    b = torch.randn(1152, 576, generator=g).to(device, dtype)
    best = float("inf")
    for _ in range(rounds + 1):  # the first one warms up
        t0 = time.perf_counter()
        float((a @ b)[0, 0])  # the read waits for the device
        best = min(best, time.perf_counter() - t0)
    return best


def measure(device: torch.device, seconds: Callable[[torch.dtype, torch.device], float] = product_seconds) -> dict:
    """{"pays", "bf16_ms", "fp32_ms"} from one timing of each kind on `device` (a CPU)."""
    bf16, fp32 = seconds(torch.bfloat16, device), seconds(torch.float32, device)
    return {"pays": bf16 < MARGIN * fp32, "bf16_ms": round(bf16 * 1e3, 3), "fp32_ms": round(fp32 * 1e3, 3)}


DECISION = Decision("bf16-products", "", 1, measure,
                    "whether bfloat16 products run clearly faster than float32 ones here (an int format's CPU "
                    "prefill and training's autocast follow it)")


def verdict(device: torch.device | str = "cpu", refresh: bool = False) -> dict:
    """The cached measurement for `device` ({"pays": ...}); measured and stored when there is none
    (or `refresh`). On a GPU: {"pays": whether it supports bfloat16}; elsewhere {"pays": False}."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"pays": bool(torch.cuda.is_bf16_supported())}
    if device.type != "cpu":
        return {"pays": False}
    result = DECISION.stored_or_measured(device, {}, _from_json, lambda: measure(device), refresh)
    _pays.cache_clear()  # the per-process answer follows a refresh
    return result


def _from_json(data: dict) -> dict:
    if not isinstance(data.get("pays"), bool):
        raise TypeError("no verdict")
    return {k: data[k] for k in FIELDS if k in data}


@functools.lru_cache(maxsize=None)
def _pays(device_type: str) -> bool:
    return bool(verdict(torch.device(device_type))["pays"])


def bf16_products_pay(device: torch.device | str = "cpu") -> bool:
    """Whether bfloat16 products are clearly faster than float32 ones on `device` (read once a process)."""
    return _pays(torch.device(device).type)
