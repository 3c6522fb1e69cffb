"""A decoder layer's front half in one call for a CPU's short int4 passes.

A 1-token int4 pass of SmolLM2-135M (30 layers) spent about 49 us a layer in the calls themselves
(Python, ctypes, the operators between the kernels: the same pass with every width shrunk to 64
took 1.48 ms), a third of the pass. `bind` gives one C call (cpu_layer.c) that runs the kernels the
pass would call one by one, in the same order, over the same buffers: the input RMSNorm
(cpu_rms_norm), the fused q/k/v product (cpu_packed_mm), RoPE and the cache writes (cpu_rope_write),
row attention (cpu_row_attention), the o product with its residual, the post-attention RMSNorm and
the fused gate/up product. Each kernel is handed to it by address, so every number is the one the
separate calls compute (tests/test_layer_calls.py compares the passes bit for bit).

- **Kernel**: `bind(...)` -> `LayerFront` (`front(x, cos, sin, pos, end)` -> (x2, gate_up)), or None
  where a part is not the kernel it takes (the caller keeps the calls one by one).
- **Reference**: the pass's own calls one by one (viasd_core/decoding/model.py `_layer`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import cpu_build, cpu_row_attention

SOURCE = Path(__file__).with_name("cpu_layer.c")
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [("norm", _P), ("int4_mm", _P), ("rope", _P), ("attention", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm_in", _P), ("norm_post", _P), ("eps_in", _F), ("eps_post", _F),
                ("qkv_q", _P), ("qkv_sz", _P), ("qkv_n", _I64), ("o_q", _P), ("o_sz", _P),
                ("gate_up_q", _P), ("gate_up_sz", _P), ("gate_up_n", _I64), ("k_cache", _P), ("v_cache", _P),
                ("slots", _I64), ("group", _I64), ("hidden", _I), ("heads", _I), ("kv_heads", _I),
                ("head_dim", _I), ("scale", _F), ("window", _I)]


def _function(build_dir: Path):
    return cpu_build.function(SOURCE, build_dir, "viasd_layer_front",
                              [_P, _P, _I] + [_P] * 8 + [_P, _P, _P, _I, _I])


def why_not() -> str | None:
    """Why the kernel could not be built here (None: it was, or was not tried yet)."""
    return cpu_build.why_not(SOURCE)


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class LayerFront:
    """One layer's front half bound to its weights and cache; `parts` keeps what the pointers point into."""

    __slots__ = ("fn", "kernels", "layer", "parts", "writer", "hidden", "heads", "head_dim", "qkv_n", "gate_up_n",
                 "sources")

    def __init__(self, fn, kernels: _Kernels, layer: _Layer, parts: tuple, writer):
        self.fn, self.kernels, self.layer, self.parts, self.writer = fn, kernels, layer, parts, writer
        self.sources: tuple = ()  # the caller's: what it bound the products from (to notice replaced weights)
        self.hidden, self.heads, self.head_dim = layer.hidden, layer.heads, layer.head_dim
        self.qkv_n, self.gate_up_n = layer.qkv_n, layer.gate_up_n

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, pos: torch.Tensor,
                 end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, hidden] bfloat16 contiguous at slots pos [T] (int64), cos and sin_signed [T, head_dim],
        attending the cache up to `end` -> (x + attention output projected [1, T, hidden], the gate/up
        product [1, T, gate_up_n])."""
        T = x.shape[1]
        bf = torch.bfloat16
        h, h2 = torch.empty(T, self.hidden, dtype=bf), torch.empty(T, self.hidden, dtype=bf)
        qkv = torch.empty(T, self.qkv_n, dtype=bf)
        q = torch.empty(self.heads, T, self.head_dim, dtype=bf)
        a = torch.empty(T, self.heads * self.head_dim, dtype=bf)
        x2 = torch.empty(1, T, self.hidden, dtype=bf)
        gu = torch.empty(1, T, self.gate_up_n, dtype=bf)
        rc = self.fn(ctypes.addressof(self.kernels), ctypes.addressof(self.layer), T, x.data_ptr(), h.data_ptr(),
                     qkv.data_ptr(), q.data_ptr(), a.data_ptr(), x2.data_ptr(), h2.data_ptr(), gu.data_ptr(),
                     cos.data_ptr(), sin_signed.data_ptr(), pos.data_ptr(), end, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the layer kernel's step {rc} refused its arguments: x {tuple(x.shape)}, end {end}, "
                             f"slots {pos.tolist()}")
        return x2, gu


def bind(norm_in, norm_post, qkv, o, gate_up, writer, heads: int, scale: float, window: int | None, *,
         build_dir: Path) -> LayerFront | None:
    """The front half over one layer's bound kernels: `norm_in`, `norm_post` (cpu_rms_norm.Norm),
    `qkv`, `o`, `gate_up` (cpu_packed_mm.Bound over int4 weights, q/k/v and gate/up fused), `writer`
    (cpu_rope_write.RopeWriter over the layer's cache), the attention's `scale` and sliding `window`
    (None: none); or None where one of them is missing, is not bfloat16 int4, or their sizes do not
    fit together."""
    parts = (norm_in, norm_post, qkv, o, gate_up, writer)
    if any(p is None or p is False for p in parts):
        return None
    d, hkv, hidden = writer.d, writer.hkv, norm_in.h
    int4 = all(len(b.tail) == 1 and b.tail[0] == qkv.tail[0] and b.fn is qkv.fn for b in (qkv, o, gate_up))
    fits = (int4 and norm_in.dtype == norm_post.dtype == writer.dtype == torch.bfloat16 and norm_post.h == hidden
            and qkv.k == hidden and qkv.n == (heads + 2 * hkv) * d and o.k == heads * d and o.n == hidden
            and gate_up.k == hidden)
    fn = _function(build_dir) if fits else None
    attention = cpu_row_attention._function(build_dir) if fn is not None else None
    if attention is None:
        return None
    kernels = _Kernels(_address(norm_in.fn), _address(qkv.fn), _address(writer.fn), _address(attention))
    layer = _Layer(norm_in.ptr, norm_post.ptr, norm_in.eps, norm_post.eps, qkv.ptrs[0], qkv.ptrs[1], qkv.n,
                   o.ptrs[0], o.ptrs[1], gate_up.ptrs[0], gate_up.ptrs[1], gate_up.n, writer.kc, writer.vc, writer.s,
                   qkv.tail[0], hidden, heads, hkv, d, scale, window or 0)
    return LayerFront(fn, kernels, layer, parts, writer)
