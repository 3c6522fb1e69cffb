"""A CPU's short passes over float32 weights, each row's outputs the same whatever the pass holds.

`sd` promises `ar`'s tokens, so a position's logits must not depend on how many rows share its pass.
PyTorch's float32 products on a CPU (F.linear, oneDNN's packed product, the `torch.bmm` blocked
product of viasd_core/runtime/short_products.py) choose their kernels, and so their summation
orders, by the number of rows: on SmolLM2-135M every row of every pass of 2-16 rows differed from
the same row computed alone (~5e-5 in the logits). This kernel computes each output by one fixed
sequence over its row and its weights (16 float32 lanes over the inputs in order, one fused
multiply-add a step where the CPU has FMA, the lanes added in a fixed tree; cpu_f32_mm.c says how),
whatever the pass's width, the thread count and the thread that runs it.

Timings (2-core Intel Xeon, Sapphire Rapids with AVX-512, `benchmarks/experiments/f32_mm.py`, SmolLM2-135M's
shapes, under other processes' load; docstring of that script): with the weights coming from memory
as in a model's pass (`--cold 128`, 1 thread) this product was the fastest of the four at every
width, or within 3% (F.linear's 1-row k/v product, oneDNN's 16-row gate/up product), and 1.2-2.0x
F.linear at 4-16 rows. With the weights hot in L2 (2 threads), F.linear is faster at 2 rows (8.4 us
against 10.9 for q/o) and at 1 row of k/v (5.5 against 5.9), oneDNN's packed product at 16 rows of
gate/up (109 us against 119); at 1 row and at 4-16 rows otherwise this one is the fastest.

- **Kernel**: `bind(weight, bias=None, build_dir=...)` -> `Bound` (`bound(x)` for x [..., K] float32
  of 1 to MAX_ROWS rows -> [..., N]; `bound(x, residual)` -> `residual + x W^T (+ bias)`, bit for bit
  PyTorch's add), or None where it does not take the weight (not a contiguous float32 [N, K] CPU
  tensor with K a multiple of 16, a bias that is not [N] float32) or cannot be built here
  (`why_not`), and the caller keeps its PyTorch product. The bound weight is read in place, never
  copied: a call after the weight's storage was replaced raises ValueError (bind again).
- **Reference**: `f32_mm_reference`, the same sums in float64 before the kernel's roundings
  (tests/kernels/test_kernels_cpu_f32_mm.py compares them, and checks each row bit for bit across pass
  widths, thread counts and an AVX2-only build).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_f32_mm.c")
MAX_ROWS, LANES = 16, 16  # the C file's limits: 1 to 16 rows, inputs a multiple of 16
_F32 = torch.float32


_ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
ARGTYPES = {  # as the prototypes at the top of cpu_f32_mm.c
    # x, w, bias, M, N, K, out, residual, threads
    "viasd_f32_mm": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i32],
    # x, w, bias, M, N, K, out, residual, ld (out's and residual's row stride), threads
    "viasd_f32_mm_ld": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i32],
    "viasd_f32_mm_vector_bits": [],
}


def _function(build_dir: Path, name: str = "viasd_f32_mm"):
    try:
        return cpu_build.function(SOURCE, build_dir, name, ARGTYPES[name])
    except TypeError:  # a cpu_build that types every function from viasd_kernels.h's prototypes
        return cpu_build.function(SOURCE, build_dir, name)


def vector_bits(build_dir: Path) -> int | None:
    """The widest vectors the kernel's build targets (512: AVX-512, 256: AVX2, ...; the numbers are
    the same whichever), or None where it cannot be built here."""
    fn = _function(build_dir, "viasd_f32_mm_vector_bits")
    return None if fn is None else fn()


def why_not() -> str | None:
    """Why the kernel could not be built here (None: it was, or was not tried yet)."""
    return cpu_build.why_not(SOURCE)


class Bound:
    """One layer's short-pass product, bound to its weight (and bias): `bound(x)` for x [..., K]
    float32, contiguous, on the CPU, of 1 to MAX_ROWS rows -> a new [..., N] float32 tensor. A pass
    calls it for every layer, so it checks what is cheap to check and calls the kernel."""

    __slots__ = ("fn", "weight", "bias", "ptr", "bias_ptr", "n", "k")

    def __init__(self, fn, weight: torch.Tensor, bias: torch.Tensor | None):
        self.fn, self.weight, self.bias = fn, weight, bias
        self.ptr, self.bias_ptr = weight.data_ptr(), None if bias is None else bias.data_ptr()
        self.n, self.k = weight.shape

    @property
    def weights(self) -> tuple[torch.Tensor, ...]:
        """The tensors the kernel reads in place (the weight, and the bias where there is one)."""
        return (self.weight,) if self.bias is None else (self.weight, self.bias)

    def check(self) -> None:
        """Binds the weight (and bias) again where their storage moved (`.data =`), as long as the
        kernel takes them at the bound sizes; ValueError otherwise (bind again). A caller that hands
        the addresses on (cpu_layer's float32 layer front) calls it; a call of its own refuses a
        moved weight instead."""
        w, b = self.weight, self.bias
        if not takes(w, b) or tuple(w.shape) != (self.n, self.k):
            raise ValueError(f"the float32 product's weight was replaced by {tuple(w.shape)} {w.dtype} on {w.device}, "
                             f"which it does not take at [{self.n}, {self.k}]: bind it again")
        self.ptr, self.bias_ptr = w.data_ptr(), None if b is None else b.data_ptr()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]; with `residual` ([..., N] float32, contiguous) `residual + x W^T
        (+ bias)` in the same call, bit for bit PyTorch's add of the two (the product rounded first)."""
        shape = x.shape
        if x.dtype is not _F32 or not x.is_cpu or not x.is_contiguous():
            raise ValueError(f"the float32 product takes contiguous float32 CPU rows, not {x.dtype} on {x.device}"
                             f"{'' if x.is_contiguous() else ', non-contiguous'}")
        if not shape or shape[-1] != self.k:
            raise ValueError(f"the float32 product takes rows of {self.k} inputs, not {tuple(shape)}")
        m = x.numel() // self.k
        if not 1 <= m <= MAX_ROWS:
            raise ValueError(f"the float32 product takes 1 to {MAX_ROWS} rows, not {m}")
        if self.weight.data_ptr() != self.ptr or (self.bias is not None and self.bias.data_ptr() != self.bias_ptr):
            raise ValueError("the float32 product's weight was replaced since it was bound: bind it again")
        out = torch.empty(*shape[:-1], self.n, dtype=_F32)
        if residual is not None and (residual.shape != out.shape or residual.dtype is not _F32 or not residual.is_cpu
                                     or not residual.is_contiguous()):
            raise ValueError(f"the float32 product's residual must be {tuple(out.shape)} float32, contiguous, "
                             f"on the CPU")
        if self.fn(x.data_ptr(), self.ptr, self.bias_ptr, m, self.n, self.k, out.data_ptr(),
                   None if residual is None else residual.data_ptr(), torch.get_num_threads()) != 0:
            raise ValueError(f"the float32 product refused x {tuple(shape)}, weight {tuple(self.weight.shape)}")
        return out


def takes(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes `weight` (and `bias`): float32 [N, K] on the CPU, contiguous, K a
    multiple of LANES; a bias [N] float32, contiguous, on the CPU."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[0] > 0 and weight.shape[1] > 0
            and weight.shape[1] % LANES == 0
            and (bias is None or (bias.device.type == "cpu" and bias.dtype == torch.float32
                                  and tuple(bias.shape) == (weight.shape[0],) and bias.is_contiguous())))


def bind(weight: torch.Tensor, bias: torch.Tensor | None = None, *, build_dir: Path) -> Bound | None:
    """The short-pass product over `weight` [N, K] (and `bias` [N]), or None where the kernel does not
    take them (`takes`) or cannot be built here (`why_not()`). Tensors that need gradients are bound
    as they are (the kernel has no backward: the caller keeps autograd's passes off it); the bound
    tensors are kept, not copies, so that a replaced storage (`layer.weight.data = other`) is seen."""
    fn = _function(build_dir) if takes(weight, bias) else None
    if fn is None:
        return None
    return Bound(fn, weight, bias)


def f32_mm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in float64 before its roundings: x [..., K] @ weight [N, K]^T + bias.
    [..., N] float64."""
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()
