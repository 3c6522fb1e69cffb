"""An int4 weight widened to bfloat16 in one pass over its packed bytes, for a CPU prefill.

A prompt's prefill runs each int4 layer as one dense product over its weight widened to bfloat16
(viasd_core/runtime/packed_linear.py: PackedLinear.widened, once per layer and prefill). PyTorch's
operators widen it in five passes over a float32 copy: 41-51 ms for SmolLM2-135M's 30 layers on a
2-core AMD EPYC, a fifth to a third of a 300-token prefill. `widen` computes each output's 16
possible values per group of inputs once (the operators' arithmetic, step by step) and writes every
weight as the value its 4 bits name: 12 ms for the same layers with AVX-512 (the plain C loop, built
for AVX2 only on the same CPU: about two thirds of the operators' time), bit for bit the operators'
result (cpu_int4_widen.c says how; docs/experiments/pass-python-int4-prefill-widening.md).

- **Kernel**: `widen(qdata, group, scale_and_zero, block, build_dir=...)`, a C function built once per
  machine (cpu_build.py); None where it does not apply or cannot be built (the caller then widens
  with PyTorch's operators).
- **Reference**: packed_cpu._int4_dense_reference, the operators (tests/kernels/test_kernels_cpu_int4_widen.py
  compares the two bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_int4_widen.c")
MAX_BLOCK, MAX_GROUP = 64, 256  # the C file's limits


def _function(build_dir: Path):
    return cpu_build.function(SOURCE, build_dir, "viasd_int4_widen")


def why_not() -> str | None:
    """Why the kernel could not be built here (None: it was, or was not tried yet)."""
    return cpu_build.why_not(SOURCE)


def widen(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int, *,
          build_dir: Path) -> torch.Tensor | None:
    """The weight [N, K] in bfloat16 of a CPU int4 weight packed by PyTorch in blocks of `block`
    outputs (qdata [N, K / 2] uint8, scale_and_zero [K / group, N, 2] bfloat16): q * scale +
    (zero - 8 * scale) in float32, rounded once. None where the kernel does not take these tensors
    or cannot run here."""
    if qdata.dim() != 2:
        return None
    n, k = qdata.shape[0], qdata.shape[1] * 2
    if (qdata.device.type != "cpu" or qdata.dtype != torch.uint8 or not qdata.is_contiguous()
            or scale_and_zero.dtype != torch.bfloat16 or scale_and_zero.device.type != "cpu"
            or tuple(scale_and_zero.shape) != (k // group, n, 2) or not 0 < block <= MAX_BLOCK
            or n % block or not 0 < group <= MAX_GROUP or k % group):
        return None
    fn = _function(build_dir)
    if fn is None:
        return None
    sz = scale_and_zero.contiguous()
    out = torch.empty(n, k, dtype=torch.bfloat16)
    rc = fn(qdata.data_ptr(), sz.data_ptr(), n, k, group, block, out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None
