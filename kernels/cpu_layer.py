"""A decoder layer's front half in one call for a CPU's short int4 and float32 passes.

A 1-token int4 pass of SmolLM2-135M (30 layers) spent about 49 us a layer in the calls themselves
(Python, ctypes, the operators between the kernels: the same pass with every width shrunk to 64
took 1.48 ms), a third of the pass. `bind` gives one C call (cpu_layer.c) that runs the kernels the
pass would call one by one, in the same order, over the same buffers: the input RMSNorm
(cpu_rms_norm), the fused q/k/v product (cpu_packed_mm), RoPE and the cache writes (cpu_rope_write),
row attention (cpu_row_attention), the o product with its residual, the post-attention RMSNorm and
the fused gate/up product. Each kernel is handed to it by address, so every number is the one the
separate calls compute (tests/runtime/test_layer_calls.py compares the passes bit for bit).

Float32 layers (`bind_f32`) run the same calls with viasd_kernels.cpu_f32_mm's row-invariant
product, the one a row-invariant float32 pass calls one by one, over the layer's own seven weights
(nothing fused or copied: q, k and v write side by side into one buffer, gate and up into another).

- **Kernel**: `bind(...)` (int4) or `bind_f32(...)` -> `LayerFront` (`front(x, cos, sin, pos, end)` ->
  (x2, gate_up)), or None where a part is not the kernel it takes (the caller keeps the calls one by one).
- **Reference**: the pass's own calls one by one (viasd_core/runtime/model.py `_layer`).
- **Checks**: the call refuses (ValueError, one line) what would make the C code read or write the
  wrong memory: x, cos, sin or pos not of the bound shapes, dtypes (pos int64: an int32 `pos` would
  be read two slots at a time) or layouts, not on the CPU, more rows than MAX_ROWS, `end` short of
  the pass or past the cache; a slot outside the cache is refused by the kernel before anything is
  written. A bound tensor whose storage moved (`.data =` on a weight or the cache) is bound again
  (its part's `check`), or refused where the kernels do not take it now: ~1 us a call for all of it.
  The structs are viasd_kernels.h's (`struct viasd_layer_kernels`, `struct viasd_layer`), read from
  the header; tests/kernels/test_kernels_contract.py compares their layout with the compiler's.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from . import cpu_build, cpu_f32_mm, cpu_header, cpu_packed_mm, cpu_row_attention

SOURCE = Path(__file__).with_name("cpu_layer.c")


class _Kernels(ctypes.Structure):
    _fields_ = cpu_header.struct_fields("viasd_layer_kernels")


class _Layer(ctypes.Structure):
    _fields_ = cpu_header.struct_fields("viasd_layer")


def _function(build_dir: Path):
    return cpu_build.function(SOURCE, build_dir, "viasd_layer_front")


def why_not() -> str | None:
    """Why the kernel could not be built here (None: it was, or was not tried yet)."""
    return cpu_build.why_not(SOURCE)


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


_data_ptr = torch.Tensor.data_ptr
_BF16, _F32, _INT64 = torch.bfloat16, torch.float32, torch.int64
_CODES = {_F32: 0, _BF16: 1}  # struct viasd_layer's dtype: the layer's activations (and so its products)
_scratch = threading.local()  # per thread: (rows, sizes) -> the buffers a call writes and reads again itself


def _scratch_for(key: tuple) -> tuple[int, ...]:
    """The addresses of the call's own buffers (h, qkv, q, a, h2) for `key` = (T, hidden, qkv_n,
    heads, head_dim, dtype), made once per thread and shape: nothing outside the call reads them, and each
    is written before it is read, so every call of every layer of that shape takes the same ones
    (five fewer tensors a call: ~3.4 us each on a 2-core Zen 3)."""
    held, kept = _scratch.__dict__.setdefault("held", {}), _scratch.__dict__.setdefault("kept", [])
    if key not in held:
        T, hidden, qkv_n, heads, head_dim, dt = key
        tensors = (torch.empty(T, hidden, dtype=dt), torch.empty(T, qkv_n, dtype=dt),
                   torch.empty(heads, T, head_dim, dtype=dt), torch.empty(T, heads * head_dim, dtype=dt),
                   torch.empty(T, hidden, dtype=dt))
        kept.append(tensors)  # alive for the thread's life: held keeps their addresses
        held[key] = tuple(map(_data_ptr, tensors))
    return held[key]


def _watched(parts: tuple) -> tuple[torch.Tensor, ...]:
    """The tensors whose addresses the layer struct holds (or is computed from): parts are the two
    norms, the products (int4: qkv, o, gate_up; float32: q, k, v, o, gate, up) and the RoPE writer."""
    norm_in, norm_post, *products, writer = parts
    return (norm_in.weight, norm_post.weight, *(w for p in products for w in p.weights), *writer.caches)


def _layer(parts: tuple, heads: int, scale: float, window: int) -> _Layer:
    norm_in, norm_post, *products, writer = parts
    common = dict(norm_in=norm_in.ptr, norm_post=norm_post.ptr, eps_in=norm_in.eps, eps_post=norm_post.eps,
                  k_cache=writer.kc, v_cache=writer.vc, slots=writer.s, hidden=norm_in.h, heads=heads,
                  kv_heads=writer.hkv, head_dim=writer.d, scale=scale, window=window, dtype=_CODES[writer.dtype])
    if len(products) == 6:  # float32: each product's own weight
        q, k, v, o, gate, up = products
        return _Layer(**common, w_q=q.ptr, w_k=k.ptr, w_v=v.ptr, w_o=o.ptr, w_gate=gate.ptr, w_up=up.ptr,
                      qkv_n=q.n + k.n + v.n, gate_up_n=gate.n + up.n)
    qkv, o, gate_up = products
    return _Layer(**common, qkv_q=qkv.ptrs[0], qkv_sz=qkv.ptrs[1], qkv_n=qkv.n, o_q=o.ptrs[0], o_sz=o.ptrs[1],
                  gate_up_q=gate_up.ptrs[0], gate_up_sz=gate_up.ptrs[1], gate_up_n=gate_up.n, group=qkv.tail[0])


class LayerFront:
    """One layer's front half bound to its weights and cache; `parts` keeps what the pointers point into."""

    __slots__ = ("fn", "kernels", "layer", "parts", "writer", "hidden", "heads", "head_dim", "qkv_n", "gate_up_n",
                 "sources", "watched", "ptrs", "scale", "window", "slots", "sizes", "scratch", "kernels_at", "layer_at",
                 "dtype")

    def __init__(self, fn, kernels: _Kernels, parts: tuple, heads: int, scale: float, window: int):
        self.fn, self.kernels, self.parts, self.writer = fn, kernels, parts, parts[-1]
        self.dtype = self.writer.dtype  # the activations' (bfloat16 over int4 weights, or float32)
        self.heads, self.scale, self.window = heads, scale, window
        self.sources: tuple = ()  # the caller's: what it bound the products from (to notice replaced weights)
        self._bind()

    def _bind(self) -> None:
        self.layer = _layer(self.parts, self.heads, self.scale, self.window)
        self.hidden, self.head_dim = self.layer.hidden, self.layer.head_dim
        self.qkv_n, self.gate_up_n, self.slots = self.layer.qkv_n, self.layer.gate_up_n, self.layer.slots
        self.sizes = {T: (torch.Size((1, T, self.hidden)), torch.Size((T, self.head_dim)), torch.Size((T,)))
                      for T in range(1, cpu_packed_mm.MAX_ROWS + 1)}
        self.scratch = {T: (T, self.hidden, self.qkv_n, self.heads, self.head_dim, self.dtype)
                        for T in range(1, cpu_packed_mm.MAX_ROWS + 1)}
        self.kernels_at, self.layer_at = ctypes.addressof(self.kernels), ctypes.addressof(self.layer)
        self.watched = _watched(self.parts)
        self.ptrs = tuple(map(_data_ptr, self.watched))

    def check(self) -> None:
        """Binds the layer again where a bound tensor's storage moved (`.data =`), through each part's
        own check (ValueError where a part does not take its new tensor, or the sizes no longer fit)."""
        if tuple(map(_data_ptr, self.watched)) == self.ptrs:
            return
        for part in self.parts:
            part.check()
        before = (self.hidden, self.head_dim, self.qkv_n, self.gate_up_n, self.layer.kv_heads, self.layer.slots)
        layer = _layer(self.parts, self.heads, self.scale, self.window)
        if (layer.hidden, layer.head_dim, layer.qkv_n, layer.gate_up_n, layer.kv_heads) != before[:5]:
            raise ValueError("the layer kernel's tensors were replaced by ones of other sizes: bind it again")
        self._bind()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, pos: torch.Tensor,
                 end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, hidden] contiguous in the layer's dtype (bfloat16 for int4, float32) at slots pos [T]
        (int64), cos and sin_signed [T, head_dim] alike, attending the cache up to `end` -> (x + attention
        output projected [1, T, hidden], the gate/up product [1, T, gate_up_n])."""
        # Every check in one expression, each tensor's shape read once (~0.2 us each) and compared
        # with the sizes a pass of T rows takes (`sizes`: T = 1..MAX_ROWS): ~2 us with the pointers'
        xs = x.shape
        want = self.sizes.get(xs[1]) if len(xs) == 3 else None
        if (want is None or xs != want[0] or cos.shape != want[1] or sin_signed.shape != want[1]
                or pos.shape != want[2] or x.dtype is not self.dtype or cos.dtype is not self.dtype
                or sin_signed.dtype is not self.dtype or pos.dtype is not _INT64
                or not (x.is_cpu and cos.is_cpu and sin_signed.is_cpu and pos.is_cpu)
                or not (x.is_contiguous() and cos.is_contiguous() and sin_signed.is_contiguous()
                        and pos.is_contiguous())
                or not xs[1] <= end <= self.slots):
            raise ValueError(self._wrong(x, cos, sin_signed, pos, end))
        T, dt = xs[1], self.dtype
        if tuple(map(_data_ptr, self.watched)) != self.ptrs:
            self.check()
        held = _scratch.__dict__.get("held")
        h, qkv, q, a, h2 = (held.get(self.scratch[T]) if held is not None else None) or _scratch_for(self.scratch[T])
        x2 = torch.empty(1, T, self.hidden, dtype=dt)
        gu = torch.empty(1, T, self.gate_up_n, dtype=dt)
        rc = self.fn(self.kernels_at, self.layer_at, T, x.data_ptr(), h, qkv, q, a, x2.data_ptr(), h2,
                     gu.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), pos.data_ptr(), end,
                     torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the layer kernel's step {rc} refused its arguments: x {tuple(x.shape)}, end {end}, "
                             f"slots {pos.tolist()} of {self.slots}")
        return x2, gu

    def _wrong(self, x, cos, sin_signed, pos, end) -> str:
        """What the call's arguments do not fit (one line), off the hot path."""
        T = x.shape[1] if x.dim() == 3 else None
        for name, t, dtype in (("x", x, self.dtype), ("cos", cos, self.dtype),
                               ("sin", sin_signed, self.dtype), ("pos", pos, torch.int64)):
            if t.dtype is not dtype or not t.is_cpu:
                return f"the layer kernel takes {name} {dtype} on the CPU, not {t.dtype} on {t.device}"
            if not t.is_contiguous():
                return f"the layer kernel takes {name} contiguous, not with strides {t.stride()}"
        want = {"x": (1, T, self.hidden), "cos": (T, self.head_dim), "sin": (T, self.head_dim), "pos": (T,)}
        if T is None or not 0 < T <= cpu_packed_mm.MAX_ROWS:
            return f"the layer kernel takes x [1, 1..{cpu_packed_mm.MAX_ROWS}, {self.hidden}], not {tuple(x.shape)}"
        for name, t in (("x", x), ("cos", cos), ("sin", sin_signed), ("pos", pos)):
            if tuple(t.shape) != want[name]:
                return f"the layer kernel takes {name} {list(want[name])}, not {list(t.shape)}"
        return f"the layer kernel takes end in [{T}, {self.slots}] (the pass's rows .. the cache), not {end}"


def bind(norm_in, norm_post, qkv, o, gate_up, writer, heads: int, scale: float, window: int | None, *,
         build_dir: Path) -> LayerFront | None:
    """The front half over one int4 layer's bound kernels: `norm_in`, `norm_post` (cpu_rms_norm.Norm),
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
    return _bind(parts, heads, scale, window, build_dir, int4_mm=qkv.fn) if fits else None


def bind_f32(norm_in, norm_post, q, k, v, o, gate, up, writer, heads: int, scale: float, window: int | None, *,
             build_dir: Path) -> LayerFront | None:
    """The front half over one float32 layer: its norms (cpu_rms_norm.Norm), its seven products
    (cpu_f32_mm.Bound, no biases: each weight read in place), `writer` over its float32 cache, the
    attention's `scale` and `window`; or None where one of them is missing, is not float32 or has a
    bias, or their sizes do not fit together (gate and up alike)."""
    products = (q, k, v, o, gate, up)
    parts = (norm_in, norm_post, *products, writer)
    if any(p is None or p is False for p in parts):
        return None
    d, hkv, hidden = writer.d, writer.hkv, norm_in.h
    fits = (all(type(p) is cpu_f32_mm.Bound and p.bias is None for p in products)
            and norm_in.dtype == norm_post.dtype == writer.dtype == torch.float32 and norm_post.h == hidden
            and q.k == k.k == v.k == gate.k == up.k == hidden and q.n == heads * d and k.n == v.n == hkv * d
            and o.k == heads * d and o.n == hidden and gate.n == up.n)
    fn = cpu_f32_mm._function(build_dir, "viasd_f32_mm_ld") if fits else None
    return _bind(parts, heads, scale, window, build_dir, f32_mm=fn) if fn is not None else None


def _bind(parts: tuple, heads: int, scale: float, window: int | None, build_dir: Path, *, int4_mm=None,
          f32_mm=None) -> LayerFront | None:
    norm_in, writer = parts[0], parts[-1]
    fn = _function(build_dir)
    attention = cpu_row_attention._function(build_dir) if fn is not None else None
    if attention is None:
        return None
    kernels = _Kernels(norm=_address(norm_in.fn), int4_mm=_address(int4_mm) if int4_mm else None,
                       f32_mm=_address(f32_mm) if f32_mm else None, rope=_address(writer.fn),
                       attention=_address(attention))
    return LayerFront(fn, kernels, parts, heads, scale, window or 0)
