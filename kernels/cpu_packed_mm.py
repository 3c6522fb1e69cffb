"""A CPU's short passes over int4 and int8 weights: each weight read and widened once a pass.

PyTorch's CPU kernels for the int formats (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
widen the weight and multiply in float32 for every 4 rows of a pass, so a 6-token verify pass costs
about twice a 1-token pass (docs/benchmarks.md section 30). These kernels widen each weight once a
pass, exactly, to bfloat16, and multiply every row through AVX-512 BF16's pair dot product
(cpu_packed_mm.c says how). A row's arithmetic depends only on the row: the same in a pass of 1 or
16 rows and on any thread count, so `sd` stays exact.

- **Kernels**: `bind_int4(qdata, group, scale_and_zero, block, build_dir=...)` (PyTorch's CPU int4
  layout in blocks of 64 outputs) and `bind_int8(qdata, scale, build_dir=...)` bind a layer's weight
  once and return its product (`Bound`: 1 to MAX_ROWS bfloat16 rows a call), or None where the
  kernel does not take the weight or cannot run here (no compiler, no AVX-512 BF16), and the caller
  keeps PyTorch's kernels. Whether a layer takes it depends on the layer and the machine, never on
  a pass's width, so every pass of a layer takes the same kernel.
- **References**: `int4_mm_reference` and `int8_mm_reference`, the same sums in float64 with
  PyTorch's ops (tests/test_kernels_cpu_packed_mm.py compares them, and checks rows bit for bit
  across pass widths and thread counts).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_packed_mm.c")
MAX_ROWS, BLOCK, MAX_GROUP, MAX_K8 = 16, 64, 256, 8192  # the C file's limits

_why_not: dict[Path, str] = {}


def _functions_for(build_dir: Path) -> tuple | None:
    has = cpu_build.function(SOURCE, build_dir, "viasd_packed_mm_available")
    if has is None:
        _why_not[build_dir] = cpu_build.why_not(SOURCE) or "the kernel could not be built"
        return None
    if not has():
        own = cpu_build.cpu_isa_class()
        if cpu_build.isa_class() != own and own == "avx512_bf16":
            _why_not[build_dir] = (f"{cpu_build.ISA_ENV}={cpu_build.max_isa()} caps the instruction set below "
                                   f"AVX-512 BF16")
        else:
            _why_not[build_dir] = "this CPU has no AVX-512 BF16 instructions"
        return None
    return (cpu_build.function(SOURCE, build_dir, "viasd_int4_mm"),
            cpu_build.function(SOURCE, build_dir, "viasd_int8_mm"))


def available(build_dir: Path) -> bool:
    """Whether the kernels run on this machine (built, and the CPU has AVX-512 BF16)."""
    return _functions_for(build_dir) is not None


def why_not(build_dir: Path) -> str | None:
    """Why the kernels do not run here (None: they do, or were not tried yet)."""
    return _why_not.get(build_dir)


class Bound:
    """One layer's short-pass product, bound once to its weight: `bound(x)` for x [..., K] bfloat16,
    contiguous, on the CPU, of 1 to MAX_ROWS rows -> [..., N] bfloat16. A pass calls it for every
    layer, so it checks what it hands the kernel in one expression (~0.4 us), allocates the output
    and calls the kernel; `weights` are the layer's tensors it was bound to (the caller binds again
    if they are replaced; a weight whose storage was replaced in place, `.data =`, is bound again
    here, or refused where the kernel does not take it), `reads` what the kernel reads (the weights,
    or copies of them laid out for it)."""

    __slots__ = ("fn", "weights", "reads", "ptrs", "sources", "n", "k", "tail")

    def __init__(self, fn, weights: tuple[torch.Tensor, torch.Tensor], tail: tuple[int, ...],
                 reads: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.fn, self.weights, self.tail = fn, weights, tail
        self.reads = weights if reads is None else reads
        self.ptrs = tuple(w.data_ptr() for w in self.reads)
        self.sources = tuple(w.data_ptr() for w in weights)  # where the weights were when bound
        self.n = weights[0].shape[0]
        self.k = weights[0].shape[1] * (2 if weights[0].dtype == torch.uint8 else 1)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]; with `residual` ([..., N] bfloat16, contiguous) `residual + x W^T`
        in the same call, bit for bit PyTorch's add of the two (the product rounded first)."""
        if x.dtype is not torch.bfloat16 or not x.is_cpu or x.shape[-1] != self.k or not x.is_contiguous():
            raise ValueError(f"the packed product takes contiguous bfloat16 rows of {self.k} inputs on the CPU, "
                             f"not {tuple(x.shape)} {x.dtype} on {x.device}"
                             + ("" if x.is_contiguous() else f" with strides {x.stride()}"))
        w = self.weights
        if w[0].data_ptr() != self.sources[0] or w[1].data_ptr() != self.sources[1]:
            self.check()
        m = x.numel() // self.k
        out = torch.empty(*x.shape[:-1], self.n, dtype=torch.bfloat16)
        if residual is not None and (residual.shape != out.shape or residual.dtype is not torch.bfloat16
                                     or not residual.is_cpu or not residual.is_contiguous()):
            raise ValueError(f"the packed product's residual must be {tuple(out.shape)} bfloat16, contiguous, "
                             f"on the CPU, not {tuple(residual.shape)} {residual.dtype} on {residual.device}")
        rc = self.fn(x.data_ptr(), *self.ptrs, m, self.n, self.k, *self.tail, out.data_ptr(),
                     None if residual is None else residual.data_ptr(), torch.get_num_threads())
        if rc != 0:
            why = "out of memory" if rc == -3 else f"arguments it does not take (code {rc})"
            raise ValueError(f"the packed product failed: {why}: x {tuple(x.shape)}, weight {tuple(self.weights[0].shape)}")
        return out

    def check(self) -> None:
        """Binds the weights again where their storage moved (`.data =`: what the kernel read was
        freed), laying them out again; ValueError where the kernel does not take them now."""
        qdata, scale = self.weights
        if (qdata.data_ptr(), scale.data_ptr()) == self.sources:
            return
        int4 = qdata.dtype == torch.uint8
        if int4:
            takes = _takes_int4(qdata, self.tail[0], scale, BLOCK)
        else:
            takes = _takes_int8(qdata, scale)
        if not takes or qdata.shape[0] != self.n:
            raise ValueError(f"the packed product's weight was replaced by {tuple(qdata.shape)} {qdata.dtype} "
                             f"(scales {tuple(scale.shape)}) on {qdata.device}, which it does not take: bind it again")
        self.reads = (qdata, scales_by_block(scale, BLOCK)) if int4 else (qdata, scale)
        self.ptrs = tuple(w.data_ptr() for w in self.reads)
        self.sources = (qdata.data_ptr(), scale.data_ptr())


def _takes_int4(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int | None) -> bool:
    n, k = qdata.shape[0], qdata.shape[1] * 2 if qdata.dim() == 2 else -1
    return (qdata.device.type == "cpu" and qdata.dtype == torch.uint8 and qdata.dim() == 2 and qdata.is_contiguous()
            and block == BLOCK and n % BLOCK == 0 and 0 < group <= MAX_GROUP and group % 2 == 0 and k % group == 0
            and scale_and_zero.device.type == "cpu" and scale_and_zero.dtype == torch.bfloat16
            and scale_and_zero.is_contiguous() and tuple(scale_and_zero.shape) == (k // group, n, 2))


def _takes_int8(qdata: torch.Tensor, scale: torch.Tensor) -> bool:
    return (qdata.device.type == "cpu" and qdata.dtype == torch.int8 and qdata.dim() == 2 and qdata.is_contiguous()
            and qdata.shape[1] % 32 == 0 and qdata.shape[1] <= MAX_K8 and scale.device.type == "cpu"
            and scale.dtype == torch.bfloat16 and scale.is_contiguous() and tuple(scale.shape) == (qdata.shape[0],))


def bind_int4(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int | None, *,
              build_dir: Path) -> Bound | None:
    """The short-pass product of a CPU int4 weight (qdata [N, K / 2] uint8 in PyTorch's layout with
    blocks of `block` outputs, scale_and_zero [K / group, N, 2] bfloat16, contiguous), or None where
    the kernel does not take it or cannot run here. The kernel reads a copy of the scales laid out
    block by block (`scales_by_block`: K * N * 4 / group bytes more, a quarter of the weight's at group
    32), which a 1-token pass streams instead of missing on one every group (cpu_packed_mm.c)."""
    takes = _takes_int4(qdata, group, scale_and_zero, block)
    fns = _functions_for(build_dir) if takes else None
    if fns is None:
        return None
    return Bound(fns[0], (qdata, scale_and_zero), (group,), (qdata, scales_by_block(scale_and_zero, BLOCK)))


def scales_by_block(scale_and_zero: torch.Tensor, block: int) -> torch.Tensor:
    """PyTorch's int4 scales [K / group, N, 2] laid out as the kernel reads them: [N / block,
    K / group, block, 2], each block's groups one after another."""
    groups, n, _ = scale_and_zero.shape
    return scale_and_zero.view(groups, n // block, block, 2).permute(1, 0, 2, 3).contiguous()


def bind_int8(qdata: torch.Tensor, scale: torch.Tensor, *, build_dir: Path) -> Bound | None:
    """The short-pass product of an int8 weight qdata [N, K] with a bfloat16 scale per output, or None
    where the kernel does not take it or cannot run here."""
    takes = _takes_int8(qdata, scale)
    fns = _functions_for(build_dir) if takes else None
    return None if fns is None else Bound(fns[1], (qdata, scale), ())


def int4_mm_reference(x: torch.Tensor, codes: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """What `int4_mm` computes, in float64 before its one rounding, from the weight's 4-bit codes
    [N, K] (0..15, read back from the packed layout): for each output, over each group,
    scale * sum(x * (q - 8)) + zero * sum(x). [M, N] float64."""
    n, k = codes.shape
    q = (codes.double() - 8).view(n, k // group, group)
    scale, zero = scale_and_zero.double().permute(2, 1, 0)  # each [N, K / group]
    xg = x.double().view(x.shape[0], k // group, group)
    d = torch.einsum("mgk,ngk->mng", xg, q)
    return (d * scale + xg.sum(-1)[:, None, :] * zero).sum(-1)


def int8_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `int8_mm` computes, in float64 before its one rounding. [M, N] float64."""
    return (x.double() @ qdata.double().t()) * scale.double()
