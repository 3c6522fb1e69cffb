"""A decoder layer's calls for FastModel's pass, looked up once instead of at every pass.

A 1-token pass of a small model on a CPU spends much of its time in Python around its products:
the int4 SmolLM2 pass made ~480 nn.Module attribute lookups (`layer.self_attn`, `attn.o_proj`, ...,
~0.7 us each through nn.Module.__getattr__) and ~210 module calls (~3 us each through
nn.Module.__call__'s hook handling) a pass. `LayerCalls` holds the layer's submodules' `forward`
methods and the products' callables, made when the FastModel is built, so the pass calls them
directly. The products' arithmetic is unchanged: each callable is what the pass called before (a
packed layer's `forward`, or `short_products.linear` over a float layer with the model's current
`pass_rows`); o and down also add the residual, inside a packed layer's call (`add_to`: the kernel
adds it as it stores each output, bit for bit PyTorch's add). The RMSNorms are `norms.norm_call`'s
(a one-call kernel on CPU that sums the squares in its own order: within a rounding step of the
module's output). tests/test_layer_calls.py compares a pass with the plain module calls.

Nothing in viasd registers hooks on a decoder layer's submodules; calling `forward` skips hooks
that someone else might register (accelerate's offloading wraps `forward` itself, so it still runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from viasd_core.decoding.norms import norm_call
from viasd_core.decoding.short_products import linear, mlp
from viasd_core.decoding.weight_formats import PackedLinear

Call = Callable[[torch.Tensor], torch.Tensor]
AddCall = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, residual) -> residual + product(x)


@dataclass(frozen=True, slots=True)
class LayerCalls:
    input_norm: Call
    post_norm: Call
    q_norm: Call | None  # Qwen3's per-head norms (None elsewhere)
    k_norm: Call | None
    qkv: Call | None  # q, k and v as one product (fused_projections), split by qkv_split
    qkv_split: tuple[int, int, int]
    q: Call
    k: Call
    v: Call
    o: AddCall  # residual + o(x)
    gate_up: Call | None  # gate and up as one product, split by gate_up_split
    gate_up_split: tuple[int, int]
    act: Call | None
    down: AddCall | None  # residual + down(x)
    mlp: Call  # the whole MLP (where gate_up is None)
    scaling: float


def product(module: torch.nn.Module, model) -> Call:
    """`module`'s product as the pass calls it: a packed layer's own forward, else `linear` over the
    layer with `model`'s short-pass products as they are at the call (FastModel.pass_rows)."""
    if type(module) is PackedLinear:
        return module.forward
    return lambda x: linear(x, module, model.pass_rows)


def product_add(module: torch.nn.Module, model) -> AddCall:
    """`residual + module(x)` as the pass calls it: a packed layer's `add_to` (the add inside the
    product's call), else `product`'s result added by PyTorch."""
    if type(module) is PackedLinear:
        return module.add_to
    call = product(module, model)
    return lambda x, residual: residual + call(x)


def layer_calls(layer: torch.nn.Module, fused, model) -> LayerCalls:
    """The calls of decoder `layer` (with its fused projections `fused`, or None) for `model`'s pass."""
    attn, m = layer.self_attn, layer.mlp
    q_norm = attn.q_norm.forward if hasattr(attn, "q_norm") else None
    k_norm = attn.k_norm.forward if hasattr(attn, "k_norm") else None
    qkv = fused.qkv.forward if fused is not None and fused.qkv is not None else None
    gate_up = fused.gate_up.forward if fused is not None and fused.gate_up is not None else None
    return LayerCalls(
        input_norm=norm_call(layer.input_layernorm), post_norm=norm_call(layer.post_attention_layernorm),
        q_norm=q_norm, k_norm=k_norm,
        qkv=qkv, qkv_split=fused.qkv_split if qkv is not None else (0, 0, 0),
        q=product(attn.q_proj, model), k=product(attn.k_proj, model), v=product(attn.v_proj, model),
        o=product_add(attn.o_proj, model),
        gate_up=gate_up, gate_up_split=fused.gate_up_split if gate_up is not None else (0, 0),
        act=(m.act_fn.forward if isinstance(m.act_fn, torch.nn.Module) else m.act_fn) if gate_up is not None else None,
        down=product_add(m.down_proj, model) if gate_up is not None else None,
        mlp=lambda x: mlp(x, m, model.pass_rows),
        scaling=attn.scaling,
    )
