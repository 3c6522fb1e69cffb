"""Row-invariant attention for a CPU's short passes: each query row over its own keys, alone.

`sd` is exact when a token's logits do not depend on the pass that computed them: a position must
come out the same decoded alone (`ar`'s 1-token pass) as inside a verify block or a token tree's
pass. PyTorch's CPU attention tiles its work by the number of queries and keys in the call, so the
engine used to attend one position per call (`attention.attend_by_row`'s loop: 6 calls a layer for a
6-token pass). This kernel does all of a pass's rows in one call, and each row's arithmetic depends
only on that row's query and keys (cpu_row_attention.c says how): invariant by construction, in
float32 and bfloat16.

- **Kernel**: `row_attention(q, k, v, end, window, scale, key_mask, build_dir=...)`, a C function
  built once per machine (cpu_build.py); None where it cannot run (no compiler, a GPU tensor, another
  dtype), and the caller keeps its own path.
- **Reference**: `row_attention_reference`, the same rows in float64 with PyTorch's ops: what the
  kernel computes, up to float32 rounding (tests/kernels/test_kernels_cpu_row_attention.py compares them, and
  checks that a row's result is bit for bit the same in a pass of 1, 2, 6 or 16 rows).
- **Fast code of the AVX2 class**: a build for AVX2 without AVX-512 lays the same arithmetic out
  in registers of 8 floats (`heads8`; `lanes(build_dir)` says 8): every lane's operations the same
  and in the same order as the plain code's, which `plain=True` runs alone; the test compares them
  bit for bit (natively on AVX2 CPUs, under VIASD_MAX_CPU_ISA=avx2 above them).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_row_attention.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LANES, MAX_HEAD_DIM, MAX_GROUP = 16, 512, 16  # the C file's limits: head width a multiple of 16, 16 query heads a KV head


def _function(build_dir: Path, plain: bool = False):
    return cpu_build.function(SOURCE, build_dir, "viasd_row_attention_plain" if plain else "viasd_row_attention")


def lanes(build_dir: Path) -> int | None:
    """8 where the kernel built here lays a head's sums out for AVX2 (its fast code), 16 where it runs
    the plain code; None where it is not built."""
    fn = cpu_build.function(SOURCE, build_dir, "viasd_row_attention_lanes")
    return None if fn is None else fn()


def why_not() -> str | None:
    """Why the kernel could not be built here (None: it was, or was not tried yet)."""
    return cpu_build.why_not(SOURCE)


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, window: int | None = None,
                  scale: float | None = None, key_mask: torch.Tensor | None = None, *,
                  build_dir: Path, plain: bool = False) -> torch.Tensor | None:
    """Causal attention of q [1, Hq, T, D] at slots end - T .. end - 1 over one layer's cache k, v
    [1, Hkv, S, D] (S >= end), each row over exactly its keys: [1, T, Hq * D] in q's dtype.

    With `key_mask` [T, end] (a token tree's rows) row t reads the slots it marks, in cache order;
    without, the slots up to its own (the last `window` of them under a sliding window). None where
    the kernel cannot take these tensors here (the caller then attends its own way); ValueError, one
    line naming it, for tensors that do not fit together (shapes, `end` outside the cache or short of
    the pass, a mask that is not [T, >= end] on the CPU). `plain` runs the kernel's plain code alone
    (on the AVX2 class its fast code is another layout of the same arithmetic: the test compares them)."""
    if not q.is_cpu or q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return None
    if not k.is_cpu or not v.is_cpu or not (k.is_contiguous() and v.is_contiguous()):
        return None
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != 1 or k.shape != v.shape or k.shape[0] != 1 or k.shape[3] != q.shape[3]:
        raise ValueError(f"row attention takes q [1, Hq, T, D] and k, v [1, Hkv, S, D] alike, not q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    _, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if D % LANES or D > MAX_HEAD_DIM or Hq % Hkv or Hq // Hkv > MAX_GROUP:
        return None
    if not 0 < end <= S or (key_mask is None and end < T) or (window is not None and window < 0):
        raise ValueError(f"row attention refused its arguments: end {end} for {T} rows over a cache of {S} slots"
                         + (f", window {window}" if window is not None else ""))
    if key_mask is not None and (not key_mask.is_cpu or key_mask.dim() != 2 or key_mask.shape[0] != T
                                 or key_mask.shape[1] < end):
        raise ValueError(f"row attention refused its arguments: key_mask {tuple(key_mask.shape)} on "
                         f"{key_mask.device}, not [{T}, >= {end}] on the CPU")
    fn = _function(build_dir, plain)
    if fn is None:
        return None
    if q.stride(3) != 1:
        q = q.contiguous()
    mask = None if key_mask is None else key_mask[:, :end].to(torch.uint8).contiguous()
    out = torch.empty(1, T, Hq * D, dtype=q.dtype)
    rc = fn(q.data_ptr(), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(), DTYPES[q.dtype], T, Hq, Hkv, D, S,
            end, window or 0, None if mask is None else mask.data_ptr(), end,
            1.0 / math.sqrt(D) if scale is None else scale, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"row attention refused its arguments (code {rc}): q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, end {end}, mask {None if mask is None else tuple(mask.shape)}")
    return out


def row_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, window: int | None = None,
                            scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What `row_attention` computes, row by row in float64: [1, T, Hq * D] float64."""
    _, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    outs = []
    for t in range(T):
        if key_mask is not None:
            keys = key_mask[t, :end].nonzero().squeeze(1)
        else:
            hi = end - T + t + 1
            keys = torch.arange(0 if window is None else max(0, hi - window), hi)
        kt = k[0].double().index_select(1, keys).repeat_interleave(rep, dim=0)  # [Hq, n, D]
        vt = v[0].double().index_select(1, keys).repeat_interleave(rep, dim=0)
        p = torch.softmax(scale * (kt @ q[0, :, t].double()[:, :, None]).squeeze(-1), dim=-1)  # [Hq, n]
        outs.append((p[:, None, :] @ vt).reshape(Hq * D))
    return torch.stack(outs)[None]
