"""The packed formats' products through PyTorch's own kernels (and viasd_kernels' int8 matmul on
CUDA), at any number of rows: what `PackedLinear` (packed_linear.py) calls where neither the CPU's
packed products nor a prefill's dense product (packed_cpu.py) take a pass. Which of them a layer
calls is decided once, when the layer binds its products (`int8_mm_for`, `int4_mm_for`), never per
call. The formats and why they run so: weight_formats.py's module doc.
"""

from __future__ import annotations

from typing import Callable

import torch
from viasd_kernels import int8_mm

Product = Callable[..., torch.Tensor]


def int8_mm_for(qdata: torch.Tensor) -> Product:
    """The int8 product (x [M, K], qdata [N, K], scale [N]) -> [M, N] for a weight held as `qdata`:
    on CUDA viasd_kernels' int8 matmul (a Triton kernel that widens the weight tile by tile in
    registers: no per-call copy of the weight, inside or outside a compiled graph); elsewhere
    PyTorch's own (`_int8_mm_reference`, compared with the kernel in tests/kernels/test_kernels_int8_mm.py).
    CPU passes of DENSE_PREFILL_ROWS rows or more do not come here (packed_linear.PackedLinear)."""
    return int8_mm if qdata.is_cuda else _int8_mm_reference


def _int8_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """PyTorch's CPU int8 weight-only kernel, at any number of rows."""
    return torch._weight_int8pack_mm(x, qdata, scale)


def int8_grouped_weight(qdata: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An int8 weight [N, K] with a float32 scale for each group of K / scales.shape[1] inputs,
    widened to float32: exact (an 8-bit code times a float16 scale fits float32's 24 bits)."""
    n, k = qdata.shape
    return (qdata.float().view(n, scales.shape[1], -1) * scales[..., None]).view(n, k)


def int8_grouped_mm(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The grouped int8 product (x [M, K], qdata [N, K], scales [N, K / group] float32) -> [M, N]
    float32, over the weight widened exactly (`int8_grouped_weight`), at any number of rows, on any
    device: the calls viasd_kernels' short products do not take (traced passes, long passes)."""
    return torch.nn.functional.linear(x.float(), int8_grouped_weight(qdata, scales))


def int4_mm_for(cpu_layout: bool) -> Product:
    """The int4 product (x [M, K] with K the packed input width, qdata, group, scale_and_zero) ->
    [M, N] (N the packed output width), at any number of rows, for a weight packed in PyTorch's CPU
    layout (`_int4_mm_cpu`) or torchao's CUDA tiles (`_int4_mm`): tinygemm's kernel for that layout.
    CPU passes of DENSE_PREFILL_ROWS rows or more do not come here (packed_linear.PackedLinear)."""
    return _int4_mm_cpu if cpu_layout else _int4_mm


def _int4_mm(x: torch.Tensor, qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """tinygemm's kernel over a weight in torchao's CUDA tile layout."""
    return torch.ops.aten._weight_int4pack_mm(x, qdata, group, scale_and_zero)


def _int4_mm_cpu(x: torch.Tensor, qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """tinygemm's kernel over a weight in PyTorch's CPU layout."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qdata, group, scale_and_zero)
