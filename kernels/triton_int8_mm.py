"""Weight-only int8 matmul as one Triton kernel: the contract of `int8_mm.int8_mm_reference`
without its widened copy of the weight.

One program per (BLOCK_M rows of x, BLOCK_N output columns): it walks K in BLOCK_K steps, loads
x [BLOCK_M, BLOCK_K] and the weight tile [BLOCK_K, BLOCK_N] as int8, widens both in registers and
accumulates x @ tile in float32 (tl.dot with tf32 inputs, exact here: a bf16 or fp16 value and an
int8 fit tf32's mantissa); at the end it multiplies by the column's scale and rounds once to x's
dtype (to nearest on a GPU; the Triton interpreter truncates to bfloat16, so the CPU tests allow
one unit in the last place). No [K, N] temporary; the weight is read once per BLOCK_M rows.
BLOCK_M is 16 for up to 16 rows (every decode-shaped pass: one tile, so a row's numbers do not
depend on how many rows share the pass) and 64 beyond (prefill chunks).

The default block sizes are a first choice, not tuned on a GPU (none was available).

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when this module is imported: set
TRITON_INTERPRET=1 before importing it to run the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int8_mm import check_int8_mm_inputs

BLOCK_N, BLOCK_K = 32, 128  # defaults; tl.dot wants every block dimension >= 16


@triton.jit
def _int8_mm_kernel(
    x_ptr,  # [M, K] bfloat16 / float16, unit stride along K
    w_ptr,  # [N, K] int8, unit stride along K
    scale_ptr,  # [N]
    out_ptr,  # [M, N] out, x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0)
        # float32 operands, tf32 products (exact, see the module doc): the Triton interpreter that
        # runs the CPU tests has no bfloat16 matmul.
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="tf32", out_dtype=tl.float32)
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = acc * scale[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def int8_mm_triton(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, block_n: int | None = None,
                   block_k: int | None = None) -> torch.Tensor:
    """(x @ qdata.T) * scale without widening the weight: x [M, K] bf16/fp16, qdata [N, K] int8,
    scale [N] -> [M, N] in x's dtype. No host synchronization."""
    check_int8_mm_inputs(x, qdata, scale)
    block_n, block_k = block_n or BLOCK_N, block_k or BLOCK_K
    for name, block in (("block_n", block_n), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    x, qdata, scale = x.contiguous(), qdata.contiguous(), scale.contiguous()
    (M, K), N = x.shape, qdata.shape[0]
    block_m = 16 if M <= 16 else 64
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _int8_mm_kernel[grid](x, qdata, scale, out, M, N, K, x.stride(0), qdata.stride(0), out.stride(0),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
