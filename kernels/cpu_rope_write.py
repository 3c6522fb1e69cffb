"""RoPE on a pass's queries and keys and the cache writes of its keys and values, in one call on a CPU.

A decoder layer's pass splits its q/k/v projections, rotates q and k (`rope.apply_rope`) and writes k
and v into the layer's cache (`attention.LayerCache.update`): about twenty PyTorch operators, ~20 us
a layer of a 1-token pass on a 2-core AMD EPYC. `rope_write` does it in one C call with PyTorch's
roundings, element by element (cpu_rope_write.c says how), so its results are bit for bit those
operators'.

- **Kernel**: `bind(k_cache, v_cache, build_dir=...)` -> `RopeWriter`, bound to one layer's cache:
  `writer(q, k, v, cos, sin_signed, pos)` returns the rotated queries [1, Hq, T, D], having written
  the rotated keys and the values at slots `pos`; None where it does not take the cache or cannot be
  built (the caller then runs the operators).
- **Reference**: the operators themselves, `viasd_core.runtime.rope.apply_rope` and
  `attention.LayerCache.update` (tests/kernels/test_kernels_cpu_rope_write.py compares the two bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_rope_write.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _function(build_dir: Path):
    return cpu_build.function(SOURCE, build_dir, "viasd_rope_write")


def _takes(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (k_cache.dtype in DTYPES and k_cache.dtype == v_cache.dtype and k_cache.device.type == "cpu"
            and v_cache.device.type == "cpu" and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.shape[0] == 1 and k_cache.shape[3] % 2 == 0 and k_cache.is_contiguous()
            and v_cache.is_contiguous())


def why_not() -> str | None:
    """Why the kernel could not be built here (None: it was, or was not tried yet)."""
    return cpu_build.why_not(SOURCE)


class RopeWriter:
    """The kernel bound to one layer's cache (k_cache, v_cache [1, Hkv, S, D], contiguous, on the
    CPU): `writer(q, k, v, cos, sin_signed, pos)` for q [..., T, Hq * D], k and v [..., T, Hkv * D]
    (one pass's rows; copied first where a row is not contiguous), cos and sin_signed [T, D]
    (contiguous), pos [T] slots, in the cache's dtype: writes rope(k) and v at the slots and returns
    rope(q) [1, Hq, T, D], or None (nothing written)
    where the tensors are not this cache's dtype or shapes. Refused before anything is written
    (ValueError): a tensor not on the CPU, a slot outside the cache (the kernel checks every slot
    first). A cache whose storage was replaced (`.data =`) is bound again, or refused where the
    kernel does not take it."""

    __slots__ = ("fn", "caches", "kc", "vc", "hkv", "s", "d", "dtype", "code")

    def __init__(self, fn, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.fn, self.caches = fn, (k_cache, v_cache)
        self.kc, self.vc = k_cache.data_ptr(), v_cache.data_ptr()
        _, self.hkv, self.s, self.d = k_cache.shape
        self.dtype, self.code = k_cache.dtype, DTYPES[k_cache.dtype]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor | None:
        T, d = cos.shape
        hq = q.shape[-1] // d
        if (q.dtype is not self.dtype or k.dtype is not self.dtype or v.dtype is not self.dtype
                or k.shape[-1] != self.hkv * d or q.numel() != T * hq * d or k.numel() != T * self.hkv * d
                or v.numel() != k.numel() or q.dim() < 2 or k.dim() < 2 or v.dim() < 2
                or q.shape[-2] != T or k.shape[-2] != T or v.shape[-2] != T or v.shape[-1] != k.shape[-1]):
            return None  # not this cache's shapes or dtype: the caller runs the operators
        if not (q.is_cpu and k.is_cpu and v.is_cpu):
            raise ValueError(f"rope_write takes CPU tensors, not q on {q.device}, k on {k.device}, v on {v.device}")
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:  # a product's output laid out by column
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return self._run(q.data_ptr(), q.stride(-2), k.data_ptr(), k.stride(-2), v.data_ptr(), v.stride(-2), hq, cos,
                         sin_signed, pos)

    def fused(self, qkv: torch.Tensor, widths: tuple[int, int, int], cos: torch.Tensor, sin_signed: torch.Tensor,
              pos: torch.Tensor) -> torch.Tensor | None:
        """As the call, for q, k and v side by side in one product's output qkv [..., T, widths summed]
        (fused_projections): the kernel reads them in place, no views made (a pass's split cost ~3 us
        a layer)."""
        T, d = cos.shape
        wq, wk, wv = widths
        if (qkv.dtype is not self.dtype or not qkv.is_contiguous() or qkv.shape[-1] != wq + wk + wv
                or wk != self.hkv * d or wv != wk or wq % d or qkv.numel() != T * qkv.shape[-1]):
            return None
        if not qkv.is_cpu:
            raise ValueError(f"rope_write takes CPU tensors, not qkv on {qkv.device}")
        step, ptr, size = qkv.shape[-1], qkv.data_ptr(), qkv.element_size()
        return self._run(ptr, step, ptr + wq * size, step, ptr + (wq + wk) * size, step, wq // d, cos, sin_signed, pos)

    def _run(self, q: int, q_step: int, k: int, k_step: int, v: int, v_step: int, hq: int, cos: torch.Tensor,
             sin_signed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        T, d = cos.shape
        if (cos.dtype is not self.dtype or sin_signed.dtype is not self.dtype or d != self.d or pos.numel() != T
                or sin_signed.shape != cos.shape or not (cos.is_contiguous() and sin_signed.is_contiguous())):
            return None
        if not (cos.is_cpu and sin_signed.is_cpu and pos.is_cpu):
            raise ValueError(f"rope_write takes CPU tensors, not cos on {cos.device}, sin on {sin_signed.device}, "
                             f"pos on {pos.device}")
        if pos.dtype is not torch.int64 or not pos.is_contiguous():
            pos = pos.to(torch.int64).contiguous()
        if self.caches[0].data_ptr() != self.kc or self.caches[1].data_ptr() != self.vc:
            self.check()
        out = torch.empty(1, hq, T, d, dtype=self.dtype)
        if self.fn(q, q_step, k, k_step, v, v_step, cos.data_ptr(), sin_signed.data_ptr(), pos.data_ptr(),
                   out.data_ptr(), self.kc, self.vc, T, hq, self.hkv, d, self.s, self.code) != 0:
            raise ValueError(f"rope_write refused its arguments: a slot outside the cache of {self.s} "
                             f"(pos {pos.tolist()})")
        return out

    def check(self) -> None:
        """Binds the cache again where its storage moved (`.data =`); ValueError where the kernel does
        not take the new one (another dtype, layout or head width)."""
        kc, vc = self.caches
        if kc.data_ptr() == self.kc and vc.data_ptr() == self.vc:
            return
        if not (_takes(kc, vc) and kc.dtype is self.dtype and kc.shape[3] == self.d):
            raise ValueError(f"rope_write's cache was replaced by {tuple(kc.shape)} {kc.dtype} on {kc.device}, "
                             f"which it does not take: bind it again")
        self.kc, self.vc = kc.data_ptr(), vc.data_ptr()
        _, self.hkv, self.s, self.d = kc.shape


def bind(k_cache: torch.Tensor, v_cache: torch.Tensor, *, build_dir: Path) -> RopeWriter | None:
    """The kernel bound to one layer's cache, or None where it does not take it (another device or
    dtype, a layout other than [1, Hkv, S, D] contiguous, an odd head width) or cannot be built here."""
    fn = _function(build_dir) if _takes(k_cache, v_cache) else None
    return None if fn is None else RopeWriter(fn, k_cache, v_cache)
