"""Binding a FastModel's calls once: the C kernels each layer's eager CPU pass calls and the calls
around them (the layers', the final norm's, the head's), one set for eager passes and one for traced
passes (PyTorch's operators only), so that nothing in the pass decides a kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from viasd_kernels import cpu_layer, cpu_rms_norm, cpu_rope_write

from viasd_core.runtime import cpu_kernels
from viasd_core.runtime.layer_calls import Call, LayerCalls, layer_calls, product
from viasd_core.runtime.norms import norm_calls
from viasd_core.runtime.weight_formats import PackedLinear


@dataclass(frozen=True, slots=True)
class LayerKernels:
    """The C kernels an eager CPU pass calls for one layer, bound once to one cache's buffers and the
    layer's weights (FastModel.bind_kernels): RoPE with the cache writes (viasd_kernels.cpu_rope_write)
    and an int4 or float32 layer's front half in one call (viasd_kernels.cpu_layer); None: PyTorch's operators."""
    writer: cpu_rope_write.RopeWriter | None = None
    front: cpu_layer.LayerFront | None = None


OPERATORS = LayerKernels()  # traced passes, devices other than the CPU: every call through operators


@dataclass(frozen=True, slots=True)
class PassCalls:
    """The calls a pass makes around its C kernels, decided once (FastModel.bind_kernels): each
    layer's (layer_calls.py), the final norm's and the output head's. A model holds one set for its
    eager passes and one for its traced passes (PyTorch's operators only); the pass is handed the
    set it runs, and no call asks which it is in."""
    layers: list[LayerCalls]
    final_norm: Call
    head: Call


class KernelBinding:
    """Mixed into FastModel (model.py): binds its calls to its layers, weights and cache."""

    def bind_kernels(self, layer_front: bool | None = None, rope_kernel: bool | None = None,
                     row_kernel: bool | None = None) -> None:
        """Bind the calls of every pass, once: each layer's, the final norm's and the head's, for
        eager passes (`_calls`, `_final_norm`, `_head`: the C kernels where they apply) and for
        traced ones (`_traced_calls`: PyTorch's operators), and the C kernels every layer's eager
        CPU passes call to the cache in use (`cache.kernels`, one LayerKernels a layer): the plan a
        pass follows. Done when the cache is allocated; call it again after replacing a layer's
        weights, or to set the options (`layer_front` False: an int4 layer's calls one by one;
        `rope_kernel` False: RoPE and the cache writes through operators, and so no layer front
        either: the tests' and benchmarks' references; `row_kernel` False: attention by row one call a
        position, attention.attend_by_row_reference). A cache swapped in keeps the kernels bound to it."""
        if layer_front is not None:
            self.layer_front = bool(layer_front)
        if rope_kernel is not None:
            self.rope_kernel = bool(rope_kernel)
        if row_kernel is not None:
            self.row_kernel = bool(row_kernel)
        pairs = list(zip(self.layers, self._fused))
        self._calls = [layer_calls(layer, f, self) for layer, f in pairs]  # layer_calls.py
        self._final_norm = norm_calls(self.norm).eager  # norms.py: one call on CPU
        self._head = product(self.lm_head, self)
        self._traced_calls = PassCalls([layer_calls(layer, f, self, traced=True) for layer, f in pairs],
                                       self.norm.forward, product(self.lm_head, self, traced=True))
        self.cache.kernels = [self._bind_layer(ci) for ci in range(len(self.layers))]

    def _bind_layer(self, ci: int) -> LayerKernels:
        if self.device.type != "cpu":
            return OPERATORS
        writer = None
        if self.rope_kernel and self._calls[ci].q_norm is None:  # Qwen3's per-head norms come first: operators
            layer_cache = self.cache.layers[ci]
            writer = cpu_kernels.rope_write(layer_cache.k, layer_cache.v)
        front = self._bind_front(ci, writer) if self.layer_front else None
        return LayerKernels(writer, front)

    def _bind_front(self, ci: int, writer) -> cpu_layer.LayerFront | None:
        """Layer `ci`'s calls up to its MLP activation in one C call (cpu_layer), where the layer is
        the plain shape and each of its calls is the kernel the front runs: an int4 layer's fused
        products, or a float32 layer's own products through the row-invariant kernel (the product a
        row-invariant float32 pass, the only one that calls the front, takes one by one); else None."""
        c, fused = self._calls[ci], self._fused[ci]
        if (writer is None or not c.front or not self.row_kernel or self.cache.cos.shape[-1] != self.shape.head_dim
                or c.act is None or c.down is None):
            return None
        norms = [call if isinstance(call, cpu_rms_norm.Norm) else None for call in (c.input_norm, c.post_norm)]
        attn, mlp = self.layers[ci].self_attn, self.layers[ci].mlp
        if self.dtype == torch.float32 and c.qkv is None and c.gate_up is None and c.q is not None:
            modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj)
            if any(type(m) is not torch.nn.Linear for m in modules):
                return None
            # the Parameters themselves (`.data =` is seen); a bias is bound too, and bind_f32 refuses it
            bound = [cpu_kernels.f32_mm(m.weight, m.bias) for m in modules]
            return cpu_kernels.layer_front_f32(*norms, *bound, writer, self.shape.n_heads, c.scaling, self.windows[ci])
        if fused is None or c.qkv is None or c.gate_up is None or self.dtype != torch.bfloat16:
            return None
        products = (fused.qkv, attn.o_proj, fused.gate_up)
        if any(type(m) is not PackedLinear or m._parameters.get("bias") is not None for m in products):
            return None
        bound = [m._short_product(m._buffers["qdata"], m._buffers["scale"]) for m in products]
        if any(b is None or b.n != m.out_features for b, m in zip(bound, products)):
            return None
        return cpu_kernels.layer_front(*norms, *bound, writer, self.shape.n_heads, c.scaling, self.windows[ci])
