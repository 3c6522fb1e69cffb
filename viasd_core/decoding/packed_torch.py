"""The packed formats' products through PyTorch's own kernels (and viasd_kernels' int8 matmul on
CUDA), at any number of rows: what `PackedLinear` (packed_linear.py) calls where neither the CPU's
packed products nor a prefill's dense product (packed_cpu.py) take a pass. The formats and why
they run so: weight_formats.py's module doc.
"""

from __future__ import annotations

import torch
from viasd_kernels import int8_mm


def _int8_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the int8 weight qdata [N, K] with one scale a row [N] -> [M, N]: on CUDA
    viasd_kernels' int8 matmul (a Triton kernel that widens the weight tile by tile in registers:
    no per-call copy of the weight, inside or outside a compiled graph); on CPU PyTorch's own
    (`_int8_mm_reference`, compared with the kernel in tests/test_kernels_int8_mm.py). CPU passes of
    DENSE_PREFILL_ROWS rows or more do not come here (packed_linear.PackedLinear.forward)."""
    if x.is_cuda:
        return int8_mm(x, qdata, scale)
    return _int8_mm_reference(x, qdata, scale)


def _int8_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """PyTorch's CPU int8 weight-only kernel, at any number of rows."""
    return torch._weight_int8pack_mm(x, qdata, scale)


def _int4_mm(x: torch.Tensor, qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K the packed input width) times an int4 weight -> [M, N] (N the packed output width):
    tinygemm's kernel on x's device, at any number of rows. CPU passes of DENSE_PREFILL_ROWS rows or
    more do not come here (packed_linear.PackedLinear.forward)."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qdata, group, scale_and_zero)
    return torch.ops.aten._weight_int4pack_mm(x, qdata, group, scale_and_zero)
