"""int4 weights in PyTorch's CPU layout for the kernel tests: random codes and (scale, zero) pairs,
and the packing that lays codes out as the kernels read them (a helper module, not a test file)."""

from __future__ import annotations

import torch


def pack(values: torch.Tensor, block: int) -> torch.Tensor:
    """values [N, K] (0..15) in PyTorch's CPU layout with blocks of `block` outputs (the inverse of
    packed_cpu._int4_unpack_cpu): byte j of row k of a block holds outputs j and j + block / 2."""
    n, k = values.shape
    v = values.to(torch.uint8).view(n // block, 2, block // 2, k)
    return (v[:, 0] | (v[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


def case(n: int, k: int, group: int, seed: int, spread: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=g)
    sz = (torch.randn(k // group, n, 2, generator=g) * spread).to(torch.bfloat16)
    return values, sz
