"""Weight-only int8 matmul: activations x [M, K] (bfloat16 or float16) times an int8 weight
w [N, K] with one scale per output row, scale [N] -> [M, N] in x's dtype.

    y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]

- **Reference** (`int8_mm_reference`): `torch.mm(x, w.t().to(x.dtype)) * scale`, the gpt-fast
  form. Every call makes a [K, N] copy of the weight in x's dtype, written and then read again
  by the matmul: 2 bytes of transient memory a weight and about 5 bytes of memory traffic a
  weight where the int8 weight alone is 1. Llama-3.1-8B's MLP projection (14336 x 4096): one
  call allocated 117,440,512 bytes (measured on CPU, torch.profiler's memory profile); its int8
  output head (128256 x 4096) would take 1.05 GB by the same arithmetic. Compiled on CUDA the
  copy stays, as read in torch 2.13's inductor (not observed: no GPU here): its default mode
  sends the matmul to cuBLAS (a matrix-vector product is decomposed only with coordinate-descent
  tuning on), so the widening is a kernel of its own that writes the whole copy.
- **Kernel** (`triton_int8_mm.int8_mm_triton`): one program per tile of outputs; it loads int8
  tiles of the weight, widens them in registers and accumulates in float32 (tl.dot). Memory:
  the output only; the weight is read once per 16 or 64 rows of x.
- Caching a widened copy once instead would hold 2 bytes a weight for the whole session on top
  of the int8 weight's 1 (an 8B model: about 24 GB, more than its 16 GB in bfloat16), which is
  what int8 is meant to save: not done.

`int8_mm` is a PyTorch custom op (`torch.ops.viasd.int8_mm`): torch.compile traces through it
with fullgraph and CUDA graphs capture its launch. On CUDA with triton it runs the kernel (once
Triton cannot run here, the reference: see `viasd_kernels._triton_fallback`); elsewhere the
reference. Not measured on a GPU yet (no timings are claimed).
"""

from __future__ import annotations

import torch


def check_int8_mm_inputs(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless x [M, K] is bfloat16/float16, qdata [N, K] int8 and scale [N], on one device."""
    if x.ndim != 2 or qdata.ndim != 2 or scale.ndim != 1:
        raise ValueError(f"int8_mm wants x [M, K], qdata [N, K], scale [N]; got {tuple(x.shape)}, "
                         f"{tuple(qdata.shape)}, {tuple(scale.shape)}")
    if x.shape[1] != qdata.shape[1] or scale.shape[0] != qdata.shape[0]:
        raise ValueError(f"int8_mm shapes disagree: x {tuple(x.shape)}, qdata {tuple(qdata.shape)}, scale {tuple(scale.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or qdata.dtype != torch.int8:
        raise ValueError(f"int8_mm wants bfloat16/float16 x and int8 qdata, got {x.dtype} and {qdata.dtype}")
    if not x.device == qdata.device == scale.device:
        raise ValueError("int8_mm's tensors must be on one device")


def int8_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The plain form (module doc): widens the whole weight to x's dtype, then one matmul. [M, N]."""
    return torch.mm(x, qdata.t().to(x.dtype)) * scale.to(x.dtype)


def _int8_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (x @ qdata.T) * scale: x [M, K] bf16/fp16, qdata [N, K] int8, scale [N] -> [M, N] in x's
    dtype. The Triton kernel on CUDA (no copy of the weight), else the reference."""
    from . import run_fused  # the package's dispatch: kernel on CUDA, reference elsewhere or on failure

    check_int8_mm_inputs(x, qdata, scale)
    return run_fused("int8 matmul", x.is_cuda, "int8_mm_triton", int8_mm_reference, x, qdata, scale)


def _int8_mm_fake(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qdata.shape[0])


def _define_op():
    """`torch.ops.viasd.int8_mm`, defined once a process. This file can be imported under a second
    name: run from a source checkout, transformers' probe for the hub's `kernels` package imports
    this repository's `kernels/` folder as `kernels`, and a second definition would replace the
    op's implementation with that copy's (whose dispatch state is not viasd_kernels')."""
    try:
        return torch.ops.viasd.int8_mm  # defined already, by viasd_kernels
    except AttributeError:
        op = torch.library.custom_op("viasd::int8_mm", _int8_mm, mutates_args=())
        op.register_fake(_int8_mm_fake)
        return op


int8_mm = _define_op()
