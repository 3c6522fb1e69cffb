"""q/k/v and gate/up as one product each (int8/int4 on CPU): the pass computes exactly what it
computes with the projections called one by one, and no weight is held twice."""

import pytest
import torch

from conftest import FAMILIES, every_kind_of_pass, tiny_model
from viasd_core.runtime import weight_formats as wf
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_format import WeightFormat

# Wider than conftest's default: k and v (2 heads x 32) fill a block of PyTorch's CPU int4 layout (64 rows)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_projections_compute_what_the_separate_ones_do(family, fmt, monkeypatch):
    model = wf.packed_copy(tiny_model(family, seed=8, **SHAPE), WeightFormat.parse(fmt))
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        hf_before = model(ids[None]).logits
    separate_model = FastModel(model, max_len=64, fuse_projections=False)
    assert separate_model._fused == [None] * len(separate_model.layers)
    separate = every_kind_of_pass(separate_model, ids)
    fast = FastModel(model, max_len=64)
    f = fast._fused[0]
    assert f is not None and f.qkv is not None and f.gate_up is not None  # both fused at this shape
    assert torch.equal(every_kind_of_pass(fast, ids), separate)
    # the model's own layers now view the fused data: one copy of every weight, and transformers'
    # forward over them (bench's baselines, fidelity) is unchanged
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.qdata.untyped_storage().data_ptr() == f.qkv.qdata.untyped_storage().data_ptr()
    with torch.no_grad():
        assert torch.equal(model(ids[None]).logits, hf_before)
    if fmt == "int4":  # a part's packed product reads the fused layer's scales (no copy); PyTorch's kernel, where
        with torch.no_grad():  # that product does not run, copies the part's column slice once, then re-uses it
            model(ids[None, :5])  # 5 rows: the kernel (30 took the widened weight)
        part, whole = attn.k_proj._short, f.qkv._short  # the short passes' kernels (None: PyTorch's)
        copy = attn.k_proj._contiguous_scale
        if part is not None:
            assert copy is None and part.reads[1].untyped_storage().data_ptr() == whole.reads[1].untyped_storage().data_ptr()
        else:
            assert copy is not None and copy.is_contiguous() and torch.equal(copy, attn.k_proj.scale)
        with torch.no_grad():
            model(ids[None, :5])
        assert attn.k_proj._contiguous_scale is copy
    assert FastModel(model, max_len=64)._fused[0] is f  # one fusion per layer, shared


def test_layers_that_cannot_share_a_layout_stay_separate():
    def packed(n_in, n_out, fmt="int4", bias=False):
        holder = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16))
        wf.apply_weight_format(holder, WeightFormat.parse(fmt))
        return holder[0]

    assert wf.fuse_rows([packed(64, 64), packed(64, 16)]) is None  # 16 rows: off the CPU layout's blocks (64 or 32)
    assert wf.fuse_rows([packed(64, 64), packed(64, 64, "int8")]) is None  # two kinds
    assert wf.fuse_rows([packed(64, 64, "int8"), packed(64, 64, "int8", bias=True)]) is None  # bias on one only
    assert wf.fuse_rows([packed(64, 64), torch.nn.Linear(64, 64)]) is None  # a float layer
    a, b = packed(64, 64, "int8", bias=True), packed(64, 128, "int8", bias=True)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = torch.cat([a(x), b(x)], dim=-1)
    fused = wf.fuse_rows([a, b])
    assert torch.equal(fused(x), want) and torch.equal(torch.cat([a(x), b(x)], dim=-1), want)
