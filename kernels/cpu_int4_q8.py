"""Short passes over int4 weights with the rows quantized to int8: the int4 products of AVX2 CPUs
without AVX-512 BF16 (cpu_int4_q8.c says how and why; llama.cpp's AVX2 path multiplies the same way).

Each row's group of G inputs (the weight's own groups) keeps 8 bits: codes xq = rint(x * 127 / a)
with a = max |x| over the group; the 4-bit weights times those codes are summed exactly in integers,
then scaled and shifted in float32 (`int4_mm_q8_reference` says it bit for bit). A row's numbers
depend only on the row, so `sd` stays exact; they are not the float32 products' (cpu_packed_mm's
portable way), and viasd binds this way only where the machine chose it (cpu_packed_mm.bind_int4).

- `functions(build_dir)`: the built products by block ({32: fn, 64: fn}, the same arguments as
  cpu_packed_mm's int4 products), or None where this CPU (or the instruction-set cap) has no AVX2 and
  FMA, or the build failed (`why_not`).
- `int8_function(build_dir)`: the same for int8 weights ([N, K], a scale an output: the int8
  format's layers and the int4 format's output head).
- `int4_mm_q8_reference(x, codes, group, scale_and_zero)`, `int8_mm_q8_reference(x, qdata, scale)`:
  the kernels' numbers with PyTorch's operators ([M, N] bfloat16).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_int4_q8.c")
BLOCKS = (32, 64)  # PyTorch's AVX2 and AVX-512 int4 layouts
CHUNK = 32  # the group must be a multiple of this (cpu_int4_q8.c: int16 lanes sum 32 inputs exactly)
WAY = "int8 activations times the 4-bit codes in integers (AVX2)"

_why_not: dict[Path, str] = {}


def functions(build_dir: Path) -> dict | None:
    """{block: the C product} built for this machine, or None (`why_not` says why)."""
    has = cpu_build.function(SOURCE, build_dir, "viasd_int4_q8_available")
    if has is None:
        _why_not[build_dir] = cpu_build.why_not(SOURCE) or "the kernel could not be built"
        return None
    if not has():
        _why_not[build_dir] = "the build does not target AVX2 and FMA here"
        return None
    return {b: cpu_build.function(SOURCE, build_dir, f"viasd_int4_mm_q8_{b}") for b in BLOCKS}


def int8_function(build_dir: Path):
    """The int8-weight product over int8 activations built for this machine (cpu_packed_mm's int8
    arguments; K a multiple of 32), or None as `functions`."""
    return None if functions(build_dir) is None else cpu_build.function(SOURCE, build_dir, "viasd_int8_mm_q8")


def why_not(build_dir: Path) -> str | None:
    """Why the int8-activation products do not run here (None: they do, or were not tried)."""
    return _why_not.get(build_dir)


def quantize_rows_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's groups as the kernel quantizes them: codes [M, K] int32 (-127..127), d [M, K / group]
    float32 (a / 127) and X [M, K / group] float32 (the group's sum in the kernel's tree)."""
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    a = xf.abs().amax(-1)
    nonzero = a > 0
    ones = torch.ones_like(a)
    idv = torch.where(nonzero, torch.tensor(127.0) / torch.where(nonzero, a, ones), torch.zeros_like(a))
    d = torch.where(nonzero, a / torch.tensor(127.0), torch.zeros_like(a))
    codes = torch.round(xf * idv[..., None]).to(torch.int32)  # float32 product, then ties to even
    lanes = torch.zeros(m, k // group, 8)
    for i in range(0, group, 8):  # lane l adds x[l], x[l + 8], ... in order
        lanes = lanes + xf[..., i : i + 8]
    u = lanes[..., :4] + lanes[..., 4:]
    big_x = (u[..., 0] + u[..., 2]) + (u[..., 1] + u[..., 3])
    return codes.view(m, k), d, big_x


def int4_mm_q8_reference(x: torch.Tensor, codes: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """The int8-activation product bit for bit ([M, N] bfloat16) from x [M, K] bfloat16, the weight's
    4-bit codes [N, K] (0..15) and scale_and_zero [K / group, N, 2] bfloat16: I = sum xq * q - 8 *
    sum xq over each group (exact), y = fma(X, zero, fma(float(I) * d, scale, y)) over the groups in
    order, rounded once to bfloat16."""
    from .cpu_packed_mm import _fma32  # the one exact fma emulation

    m, (n, k) = x.shape[0], codes.shape
    groups = k // group
    xq, d, big_x = quantize_rows_reference(x, group)
    xqg = xq.view(m, groups, group).double()
    qg = codes.view(n, groups, group).double()
    i = torch.einsum("mgk,ngk->mng", xqg, qg) - 8 * xqg.sum(-1)[:, None, :]  # exact: integers below 2^53
    dd = i.float() * d[:, None, :]  # float32 product, rounded once
    scale, zero = scale_and_zero.float().unbind(-1)  # each [K / group, N]
    y = torch.zeros(m, n)
    for g in range(groups):
        y = _fma32(dd[:, :, g], scale[g].expand(m, n), y)
        y = _fma32(big_x[:, g : g + 1].expand(m, n), zero[g].expand(m, n), y)
    return y.to(torch.bfloat16)


def int8_mm_q8_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8-weight product over int8 activations bit for bit ([M, N] bfloat16) from x [M, K]
    bfloat16, qdata [N, K] int8 and scale [N] bfloat16: for each output 8 float32 lanes, lane l of
    group g the exact sum of inputs 4 l .. 4 l + 3 of the group, acc = fma(I, d_g, acc) over the
    groups in order, the lanes folded ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)), times the scale."""
    from .cpu_packed_mm import _fma32

    m, (n, k) = x.shape[0], qdata.shape
    groups = k // CHUNK
    xq, d, _ = quantize_rows_reference(x, CHUNK)
    lanes = torch.einsum("mgli,ngli->mngl", xq.double().view(m, groups, 8, 4),
                         qdata.double().view(n, groups, 8, 4))  # exact integers
    acc = torch.zeros(m, n, 8)
    for g in range(groups):
        acc = _fma32(lanes[:, :, g].float(), d[:, g, None, None].expand(m, n, 8), acc)
    y = ((acc[..., 0] + acc[..., 4]) + (acc[..., 2] + acc[..., 6])) + ((acc[..., 1] + acc[..., 5]) + (acc[..., 3] + acc[..., 7]))
    return (y * scale.float()).to(torch.bfloat16)
