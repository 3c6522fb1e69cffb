"""The packed formats on a CPU: tinygemm's int4 layout read back, a prefill's dense product over the
widened weight (and the dtype it runs in), and the short passes' packed products (viasd_kernels'
cpu_packed_mm) bound to a layer's weight, with what viasd doctor says of each. `PackedLinear`
(packed_linear.py) calls them; the formats and why they run so: weight_formats.py's module doc.
"""

from __future__ import annotations

import torch
from viasd_kernels import cpu_int4_widen, cpu_packed_mm

from viasd_core.runtime import cpu_kernels

PACKED_KERNEL = True  # short CPU passes through viasd_kernels.cpu_packed_mm where it runs (the option's default)


# ---------------------------------------------------------------------- tinygemm's CPU layout, read back
# PyTorch packs a CPU int4 weight [N, K] for its vector width: blocks of BLOCK_N rows (64 with
# AVX-512, 32 with AVX2), each stored K-major as [K, BLOCK_N / 2] bytes whose low nibble is row j of
# the block and high nibble row j + BLOCK_N / 2 (aten/src/ATen/native/cpu/int4mm_kernel.cpp). Which
# block size this build and CPU use is found by packing a probe and reading it back; where neither
# reads back (another layout, a partial last block) the kernel is used at every size.
_INT4_CPU_BLOCKS = (64, 32)
_int4_cpu_block_of: dict[tuple[int, int], int | None] = {}


def _int4_unpack_cpu(qdata: torch.Tensor, n: int, k: int, block: int, dtype=torch.uint8) -> torch.Tensor:
    """The 4-bit values [n, k] (0..15, in `dtype`) of a CPU-packed weight in blocks of `block` rows:
    each half of a block is copied (and converted) in one pass from its nibbles."""
    b = qdata.reshape(n // block, k, block // 2)
    out = torch.empty(n // block, 2, block // 2, k, dtype=dtype, device=qdata.device)
    out[:, 0].copy_((b & 0xF).transpose(1, 2))
    out[:, 1].copy_((b >> 4).transpose(1, 2))
    return out.view(n, k)


def _int4_cpu_block(n: int, k: int) -> int | None:
    """The block size PyTorch packs an [n, k] int4 weight with here (None: not this layout)."""
    key = (n, k)
    if key not in _int4_cpu_block_of:
        rows = 128 if n % 128 == 0 else n  # every full block is laid out alike: two of the largest suffice
        probe = torch.randint(0, 16, (rows, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        _int4_cpu_block_of[key] = next(
            (b for b in _INT4_CPU_BLOCKS if rows % b == 0 and packed.shape == (rows, k // 2)
             and torch.equal(_int4_unpack_cpu(packed, rows, k, b), probe.to(torch.uint8))), None)
    return _int4_cpu_block_of[key]


def _int4_dense_cpu(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight [N, K] in `dtype` that tinygemm's CPU kernel applies: q * scale + (zero - 8 * scale)
    per group of `group` inputs, in float32, rounded once to `dtype`; None where the layout is
    unknown. In bfloat16, viasd_kernels' one-pass kernel where it runs (bit for bit the same values,
    3x faster here: cpu_int4_widen), else PyTorch's operators (`_int4_dense_reference`)."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    block = _int4_cpu_block(n, k)
    if block is None:
        return None
    if dtype == torch.bfloat16:
        w = cpu_kernels.int4_widen(qdata, group, scale_and_zero, block)
        if w is not None:
            return w
    return _int4_dense_reference(qdata, group, scale_and_zero, block).to(dtype)


def int4_widening_way() -> str:
    """How a CPU int4 prefill widens each layer's weight on this machine, and why (viasd doctor shows it)."""
    probe, shifts = torch.zeros(32, 16, dtype=torch.uint8), torch.zeros(1, 32, 2, dtype=torch.bfloat16)
    if cpu_kernels.int4_widen(probe, 32, shifts, 32) is not None:
        return "viasd_kernels' one-pass kernel (built for this CPU)"
    return f"PyTorch's operators: {cpu_int4_widen.why_not() or 'the kernel does not run here'}"


def short_products_way(packed_kernel: bool = PACKED_KERNEL) -> str:
    """How a CPU int8/int4 layer multiplies in short passes (decoding, verify blocks) on this machine,
    and why (viasd doctor shows it); `packed_kernel` False: the packed products turned off."""
    if not packed_kernel:
        return "PyTorch's kernels (the packed products are turned off)"
    way = cpu_kernels.packed_mm_way()
    if way is not None:
        return f"viasd_kernels' packed products (each weight widened once a pass: {way})"
    return f"PyTorch's kernels: {cpu_kernels.packed_mm_why_not()}"


def _int4_dense_reference(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int) -> torch.Tensor:
    """`_int4_dense_cpu` with PyTorch's operators, in float32 (not rounded): each half of a block
    unpacked to float32, times the scales, plus the shifts, in place."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    scale, zero = scale_and_zero.float().permute(2, 1, 0)  # each [N, K / group]
    w = _int4_unpack_cpu(qdata, n, k, block, torch.float32).view(n, k // group, group)
    w.mul_(scale[..., None]).add_((zero - 8 * scale)[..., None])
    return w.view(n, k)


def dense_dtype(activations: torch.dtype, bf16_pays: bool = True) -> torch.dtype:
    """The dtype of a CPU prefill's dense product: the activations', except bfloat16 where bfloat16
    products do not pay on this CPU (`bf16_pays` False: no bfloat16 instructions, the machine's
    verdict, machine/bf16.py, handed to the layer at load), then float32 over the same weight values
    (a 768-token int4 prefill of SmolLM2 on an AVX2-only CPU: 10.8 s in bfloat16)."""
    if activations == torch.bfloat16 and not bf16_pays:
        return torch.float32
    return activations


# ---------------------------------------------------------------------- the short passes' packed products
def bind_short(kind: str, qdata: torch.Tensor, scale: torch.Tensor, group: int, cpu_layout: bool,
               packed_kernel: bool = PACKED_KERNEL) -> cpu_packed_mm.Bound | None:
    """A layer's product for short CPU passes from viasd_kernels (cpu_packed_mm), bound to its
    weight (int4 in PyTorch's CPU layout: `scale` contiguous), or None (PyTorch's kernel): decided
    from the layer's tensors and the machine, never from a pass's width, so every pass of the layer
    takes the same kernel (sd == ar). None with `packed_kernel` False, and off the CPU (where no
    short product takes the weight)."""
    if not packed_kernel or qdata.device.type != "cpu":
        return None
    if kind == "int4" and cpu_layout:
        return cpu_kernels.int4_mm(qdata, group, scale, _int4_cpu_block(qdata.shape[0], qdata.shape[1] * 2))
    if scale.dim() == 2:  # int8 with a scale for each group of inputs (PackedLinear.grouped)
        return cpu_kernels.int8g_mm(qdata, scale)
    return cpu_kernels.int8_mm(qdata, scale)


def bind_rows(whole: cpu_packed_mm.Bound | None, qdata: torch.Tensor, scale: torch.Tensor,
              lo: int) -> cpu_packed_mm.Bound | None:
    """The short-pass product of an int4 layer whose `qdata` and `scale` view the rows from `lo` on
    of a fused layer bound to `whole` (fuse_rows; None: that layer takes PyTorch's kernel, and so
    does this one): `whole`'s kernel over the same bytes, its scales as the kernel reads them a
    slice of `whole`'s (its rows are whole blocks of the layout), so nothing is copied. The same
    kernel and bytes as binding the layer's own tensors (`bind_short`), which would copy its column
    slice of the scales, and lay that copy out again."""
    if whole is None:
        return None
    reads = (qdata, whole.reads[1][lo // whole.block : (lo + qdata.shape[0]) // whole.block])
    return cpu_packed_mm.Bound(whole.fn, (qdata, scale), whole.tail, reads, block=whole.block, chunks=whole.chunks)
