"""A decoder layer's calls for FastModel's pass, looked up once instead of at every pass.

A 1-token pass of a small model on a CPU spends much of its time in Python around its products:
the int4 SmolLM2 pass made ~480 nn.Module attribute lookups (`layer.self_attn`, `attn.o_proj`, ...,
~0.7 us each through nn.Module.__getattr__) and ~210 module calls (~3 us each through
nn.Module.__call__'s hook handling) a pass. `LayerCalls` holds the layer's submodules' `forward`
methods and the products' callables, made when the FastModel binds its kernels, so the pass calls
them directly. Each call is decided then, twice: for eager passes and for traced ones (torch.compile:
PyTorch's operators only), and the pass's plan says which set it calls (FastModel._run), so that no
call asks whether it is traced, or tests a device or a dtype. The products' arithmetic is unchanged:
a packed layer's bound call (PackedLinear.bind: `_eager`, `_traced`), or short_products'
`eager_linear` (what the layer takes decided at binding) or `traced_linear` over a float layer with
the model's current `pass_rows`; o and down also add the residual, inside a packed layer's call
(`_eager_add`: the kernel adds it as it stores each output, bit for bit PyTorch's add). The
RMSNorms are `norms.norm_calls`' (a one-call kernel on CPU that sums the squares in its own order:
within a rounding step of the module's output). tests/runtime/test_layer_calls.py compares a pass with the
plain module calls.

The families' layers differ here (families.py lists them): Gemma 2/3's four norms wrap the
attention's and the MLP's products (`o`, `down`, `mlp` return residual + norm(product)); Phi-3's own
fused q/k/v and gate/up layers are the `qkv` and `gate_up` calls; a MoE block (or any MLP that is not
gate/up/down) is called one row at a time in a row-invariant model's short passes (`row_by_row`).
`front` says whether the layer is the plain shape that viasd_kernels.cpu_layer computes in one call.

Nothing in viasd registers hooks on a decoder layer's submodules; calling `forward` skips hooks
that someone else might register (accelerate's offloading wraps `forward` itself, so it still runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from viasd_core.runtime import attention
from viasd_core.runtime.families import attn_softcap
from viasd_core.runtime.norms import norm_calls
from viasd_core.runtime.short_products import PLAIN, eager_linear, gated, takes_of, traced_linear
from viasd_core.runtime.weight_formats import PackedLinear

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
    q: Call | None  # None where the layer has only a fused qkv_proj (Phi-3)
    k: Call | None
    v: Call | None
    o: AddCall  # residual + o(x)
    gate_up: Call | None  # gate and up as one product, split by gate_up_split
    gate_up_split: tuple[int, int]  # gate's and up's outputs (a gated MLP's; (0, 0) for another)
    act: Call | None  # a gated MLP's activation and down product (None for another MLP); a pass
    down: AddCall | None  # that has gate and up (gate_up, or a layer front) calls them: residual + down(x)
    mlp: Call  # the whole MLP (where gate_up is None)
    scaling: float
    softcap: float | None = None  # the attention logits' tanh cap (Gemma 2), None: none
    front: bool = True  # the plain layer shape (one norm before each block, no q/k norms, no cap)
    # the layer's attention over a pass's packed mask (attention.packed_call), and by row (attention.row_call)
    attend: Callable = attention._sdpa_packed
    attend_rows: Callable | None = None


def product(module: torch.nn.Module, model, traced: bool = False) -> Call:
    """`module`'s product as the pass calls it, decided now: a packed layer's bound call (`_eager`,
    or `_traced` for a traced pass: PackedLinear.bind), else the float layer's product over `model`'s
    short-pass products as they are at the call (FastModel.pass_rows), with what the layer takes
    decided now (short_products.eager_linear; traced_linear for a traced pass)."""
    if type(module) is PackedLinear:
        return module._traced if traced else module._eager
    if traced:
        return lambda x: traced_linear(x, module, model.pass_rows)
    takes = takes_of(module)
    return lambda x: eager_linear(x, module, model.pass_rows, takes)


def product_add(module: torch.nn.Module, model, traced: bool = False) -> AddCall:
    """`residual + module(x)` as the pass calls it: a packed layer's bound add (the add inside the
    product's call: PackedLinear.add_to); a float layer's eager product with the residual handed to
    it (short_products.eager_linear: the row-invariant kernel adds it as it stores, bit for bit
    PyTorch's add; the other products add it after); else `product`'s result added by PyTorch."""
    if type(module) is PackedLinear:
        return module._traced_add if traced else module._eager_add
    if not traced:
        takes = takes_of(module)
        return lambda x, residual: eager_linear(x, module, model.pass_rows, takes, residual)
    call = product(module, model, traced)
    return lambda x, residual: residual + call(x)


def mlp_call(module: torch.nn.Module, model, traced: bool = False) -> Call:
    """The whole MLP `module` as the pass calls it: a gated MLP over `product`s (the module itself
    while the model's short-pass products are PLAIN, read at the call: short_products.mlp), another
    MLP through `row_by_row`."""
    if not gated(module):
        return row_by_row(module, model, traced)
    gate, up, down = (product(getattr(module, name), model, traced) for name in ("gate_proj", "up_proj", "down_proj"))
    act = module.act_fn

    def call(x: torch.Tensor) -> torch.Tensor:
        if model.pass_rows == PLAIN:
            return module(x)
        return down(act(gate(x)).mul_(up(x)))  # the product in act's output: no tensor more

    return call


def row_by_row(module: torch.nn.Module, model, traced: bool = False) -> Call:
    """`module(x)` over x [1, T, H]; in a row-invariant model's short eager passes one row at a
    time, each row through the same 1-row call whatever the pass holds (a MoE block routes and
    multiplies a row alone exactly as in a 1-token pass). Traced: the module (a graph rounds by its
    width anyway)."""
    if traced:
        return module

    def call(x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if T > 1 and model.pass_rows.way(T) == "invariant":
            return torch.cat([module(x[:, i : i + 1]) for i in range(T)], dim=1)
        return module(x)

    return call


def layer_calls(layer: torch.nn.Module, fused, model, traced: bool = False) -> LayerCalls:
    """The calls of decoder `layer` (with its fused projections `fused`, or None) for `model`'s
    eager passes, or with `traced` its traced ones (torch.compile: PyTorch's operators only). Its
    attention by row takes viasd_kernels' row kernel on a CPU unless `model.row_kernel` is False."""
    attn, m = layer.self_attn, layer.mlp
    norm = (lambda module: module.forward) if traced else (lambda module: norm_calls(module).eager)
    q_norm = attn.q_norm.forward if hasattr(attn, "q_norm") else None
    k_norm = attn.k_norm.forward if hasattr(attn, "k_norm") else None
    own_qkv, own_gate_up = getattr(attn, "qkv_proj", None), getattr(m, "gate_up_proj", None)  # Phi-3
    if fused is not None and fused.qkv is not None:
        qkv, qkv_split = product(fused.qkv, model, traced), fused.qkv_split
    elif own_qkv is not None:
        d, hkv = attn.head_dim, attn.num_key_value_heads
        qkv, qkv_split = product(own_qkv, model, traced), (own_qkv.out_features - 2 * hkv * d, hkv * d, hkv * d)
    else:
        qkv, qkv_split = None, (0, 0, 0)
    act = getattr(m, "act_fn", None) or getattr(m, "activation_fn", None)
    if fused is not None and fused.gate_up is not None:
        gate_up, gate_up_split = product(fused.gate_up, model, traced), fused.gate_up_split
    elif own_gate_up is not None:
        gate_up, gate_up_split = product(own_gate_up, model, traced), (own_gate_up.out_features // 2,) * 2
    else:
        gate_up, gate_up_split = None, (m.gate_proj.out_features, m.up_proj.out_features) if gated(m) else (0, 0)
    split_mlp = gate_up is not None or gated(m)  # act and down called apart (a float layer's: by a layer front)
    whole = mlp_call(m, model, traced)
    # Gemma 2/3: the attention's and the MLP's outputs normed before their residual adds, and the
    # MLP's input normed by pre_feedforward_layernorm (post_attention_layernorm norms the attention's output)
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    o = product_add(attn.o_proj, model, traced)
    down = product_add(m.down_proj, model, traced) if split_mlp else None
    if sandwich:
        after_attn, after_mlp = norm(layer.post_attention_layernorm), norm(layer.post_feedforward_layernorm)
        o_product, mlp_whole = product(attn.o_proj, model, traced), whole
        o = lambda x, residual: residual + after_attn(o_product(x))
        whole = lambda x: after_mlp(mlp_whole(x))
        if split_mlp:
            down_product = product(m.down_proj, model, traced)
            down = lambda x, residual: residual + after_mlp(down_product(x))
    softcap = attn_softcap(layer)
    return LayerCalls(
        input_norm=norm(layer.input_layernorm),
        post_norm=norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
        q_norm=q_norm, k_norm=k_norm,
        qkv=qkv, qkv_split=qkv_split,
        q=None if own_qkv is not None else product(attn.q_proj, model, traced),
        k=None if own_qkv is not None else product(attn.k_proj, model, traced),
        v=None if own_qkv is not None else product(attn.v_proj, model, traced),
        o=o,
        gate_up=gate_up, gate_up_split=gate_up_split,
        act=(act.forward if isinstance(act, torch.nn.Module) else act) if split_mlp else None,
        down=down,
        mlp=whole,
        scaling=attn.scaling,
        softcap=softcap,
        front=not sandwich and not softcap and q_norm is None,
        attend=attention.packed_call(softcap),
        attend_rows=attention.row_call(model.device, softcap, model.row_kernel and not traced),
    )
