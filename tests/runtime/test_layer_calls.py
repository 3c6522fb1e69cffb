"""A decoder layer's calls looked up once (viasd_core/runtime/layer_calls.py): the pass computes
bit for bit what it computes through nn.Module calls and attribute lookups at every pass (the RMSNorms
through norms.norm_calls' eager call in both; the residual adds of o and down inside a packed layer's call against
PyTorch's add), in every family and format, and float products follow the model's short-pass
products as they are at the call."""

import os

import pytest
import torch

from conftest import FAMILIES, every_kind_of_pass, tiny_model
from viasd_core.runtime import attention
from viasd_core.runtime import layer_calls as lc
from viasd_core.runtime import short_products as sp
from viasd_core.runtime import weight_formats as wf
from viasd_core import paths
from viasd_core.runtime.model import FastModel
from viasd_kernels import cpu_packed_mm
from viasd_core.runtime.norms import norm_calls
from viasd_core.runtime.weight_format import WeightFormat

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def module_calls(layer, fused, model) -> lc.LayerCalls:
    """The reference: every submodule called through nn.Module.__call__, looked up at each call."""
    def linear(x, module):  # what the module takes looked up at the call
        return sp.eager_linear(x, module, model.pass_rows, lambda way: sp.TAKES[way](module))

    def prod(name):
        return lambda x: linear(x, getattr(layer.self_attn, name) if name != "down_proj" else layer.mlp.down_proj)

    def mlp(x):
        m = layer.mlp
        if model.pass_rows == sp.PLAIN or not sp.gated(m):
            return m(x)
        return linear(m.act_fn(linear(x, m.gate_proj)) * linear(x, m.up_proj), m.down_proj)

    def prod_add(name):  # o and down: the residual added by PyTorch (the pass adds it inside a packed call)
        call = prod(name)
        return lambda x, residual: residual + call(x)

    qkv = fused is not None and fused.qkv is not None
    gate_up = fused is not None and fused.gate_up is not None
    return lc.LayerCalls(
        # the norms as the pass calls them (a kernel on CPU, tested in test_kernels_cpu_rms_norm.py)
        input_norm=norm_calls(layer.input_layernorm).eager, post_norm=norm_calls(layer.post_attention_layernorm).eager,
        q_norm=(lambda x: layer.self_attn.q_norm(x)) if hasattr(layer.self_attn, "q_norm") else None,
        k_norm=(lambda x: layer.self_attn.k_norm(x)) if hasattr(layer.self_attn, "k_norm") else None,
        qkv=(lambda x: fused.qkv(x)) if qkv else None, qkv_split=fused.qkv_split if qkv else (0, 0, 0),
        q=prod("q_proj"), k=prod("k_proj"), v=prod("v_proj"), o=prod_add("o_proj"),
        gate_up=(lambda x: fused.gate_up(x)) if gate_up else None,
        gate_up_split=fused.gate_up_split if gate_up else (0, 0),
        act=(lambda x: layer.mlp.act_fn(x)) if gate_up else None, down=prod_add("down_proj") if gate_up else None,
        mlp=mlp, scaling=layer.self_attn.scaling,
        attend=lambda q, k, v, mask, scale: attention.attend(q, k, v, mask, scale),
        attend_rows=lambda *args: attention.attend_by_row(*args))


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_looked_up_calls_compute_what_module_calls_do(family, fmt, monkeypatch):
    model = tiny_model(family, seed=3, **SHAPE)
    if fmt != "none":
        model = wf.packed_copy(model, WeightFormat.parse(fmt))
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(4))
    fast = FastModel(model, max_len=64)
    fast.short_rows = sp.BLOCKED  # float32: every short pass through the blocked product
    looked_up = every_kind_of_pass(fast, ids)  # int4: short passes through the layer kernel where it binds
    fast.bind_kernels(layer_front=False)  # the reference: every call one by one,
    fast._calls = [module_calls(layer, f, fast) for layer, f in zip(fast.layers, fast._fused)]  # looked up at each call
    assert torch.equal(looked_up, every_kind_of_pass(fast, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_front_in_one_call_computes_what_the_calls_one_by_one_do(family, monkeypatch):
    """int4 short passes run a layer's calls up to the MLP activation in one C call
    (viasd_kernels.cpu_layer), handed the very kernels the pass calls: the same numbers, bit for bit,
    in every kind of pass; where a part is not one of those kernels the layer keeps its calls one by
    one."""
    model = wf.packed_copy(tiny_model(family, seed=5, **SHAPE), WeightFormat.parse("int4"))
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(6))
    fast = FastModel(model, max_len=64)
    with_front = every_kind_of_pass(fast, ids)
    bound = sum(1 for k in fast.cache.kernels if k.front is not None)
    if not cpu_packed_mm.available(paths.kernel_dir()):  # not built here: PyTorch's int4 kernels, no front
        assert bound == 0 and cpu_packed_mm.why_not(paths.kernel_dir())
        assert not os.environ.get("CI"), f"the packed products must build in CI: {cpu_packed_mm.why_not(paths.kernel_dir())}"
        return
    # not taken: Qwen2's q/k/v biases, Qwen3's per-head norms, Gemma's norm (another formula)
    assert bound == (0 if family in ("qwen2", "qwen3", "gemma") else len(fast.layers)), (family, fast.cache.kernels)
    calls = []
    for ci in range(len(fast.layers)):  # the fronts bound above are the ones the passes below call
        front = fast.cache.kernels[ci].front
        if front:
            call = front.fn
            front.fn = lambda *a, call=call: calls.append(1) or call(*a)
    assert torch.equal(with_front, every_kind_of_pass(fast, ids))
    assert (len(calls) > 0) == (bound > 0)
    if bound:  # a weight replaced, the kernels bound again: the front reads the new tensor
        before = fast.cache.kernels[0].front
        fused = fast._fused[0].qkv
        fused._buffers["qdata"] = fused._buffers["qdata"].clone()
        fast.bind_kernels()
        assert torch.equal(with_front, every_kind_of_pass(fast, ids))
        front = fast.cache.kernels[0].front
        assert front is not before and front.parts[2].weights[0] is fused._buffers["qdata"]
    fast.bind_kernels(layer_front=False)
    assert all(k.front is None for k in fast.cache.kernels)
    assert torch.equal(with_front, every_kind_of_pass(fast, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_float32_layer_front_computes_what_the_calls_one_by_one_do(family):
    """Row-invariant float32 short passes run a layer's calls up to the MLP activation in one C call
    over the layer's own weights (cpu_layer.bind_f32): every kind of pass bit for bit as with the calls
    one by one; a weight replaced in place (`.data =`) is read by both."""
    fast = FastModel(tiny_model(family, seed=5, **SHAPE), max_len=64)
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(6))
    with_front = every_kind_of_pass(fast, ids)
    fronts = [k.front for k in fast.cache.kernels if k.front is not None]
    # not taken: Qwen2's q/k/v biases, Qwen3's per-head norms, Gemma's norm (another formula)
    assert len(fronts) == (0 if family in ("qwen2", "qwen3", "gemma") else len(fast.layers)), family
    calls = []
    for front in fronts:
        front.fn = lambda *a, call=front.fn: calls.append(1) or call(*a)
    assert torch.equal(with_front, every_kind_of_pass(fast, ids))
    assert (len(calls) > 0) == bool(fronts)  # the short passes called them (a prefill does not)
    fast.bind_kernels(layer_front=False)
    assert all(k.front is None for k in fast.cache.kernels)
    assert torch.equal(with_front, every_kind_of_pass(fast, ids))
    if fronts:
        w = fast.layers[0].mlp.up_proj.weight
        w.data = w.data * 1.5
        one_by_one = every_kind_of_pass(fast, ids)
        fast.bind_kernels(layer_front=True)
        fast.cache.kernels[0].front.parts[2].check()  # bound to the new storage already
        assert not torch.equal(one_by_one, with_front)
        assert torch.equal(one_by_one, every_kind_of_pass(fast, ids))
        w.data = w.data / 1.5 * 1.25  # replaced under the bound front: it binds again itself
        assert torch.equal(every_kind_of_pass(fast, ids), (fast.bind_kernels(layer_front=False), every_kind_of_pass(fast, ids))[1])


def test_float_products_read_the_models_short_rows_at_each_call(monkeypatch):
    fast = FastModel(tiny_model("llama", seed=5, **SHAPE), max_len=64)
    seen = []
    monkeypatch.setattr(lc, "eager_linear", lambda x, layer, up_to, takes, residual=None: seen.append(up_to)
                        or (layer(x) if residual is None else residual + layer(x)))
    ids = torch.randint(3, 256, (8,), generator=torch.Generator().manual_seed(6))
    for rows in (sp.PLAIN, sp.BLOCKED):
        fast.short_rows = rows  # a session measures and sets it after the model is built
        seen.clear()
        fast.forward(ids[:4], 0, 4)
        assert seen and all(up_to == rows._replace(invariant=True) == fast.pass_rows for up_to in seen)
