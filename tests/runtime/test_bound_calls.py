"""A pass's calls are decided when its model binds them, never at the call (issue #47): FastModel.
bind_kernels binds each layer's calls for eager passes and for traced ones (layer_calls.py), a packed
layer binds its own (PackedLinear.bind: `_eager`, `_traced`), a norm its kernel (norms.norm_calls), a
float layer what it takes (short_products.takes_of). So an eager pass and a traced pass of every
format run without asking whether they are traced or whether a tensor is on CUDA: both are made to
raise here, and the passes must give the numbers they give without the trap."""

import pytest
import torch

from conftest import every_kind_of_pass, tiny_model
from viasd_core.runtime import short_products as sp
from viasd_core.runtime import weight_formats as wf
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_format import WeightFormat

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
# (format, short rows, row-invariant): the float products each way, and the packed formats
CASES = [("float32", sp.BLOCKED, True), ("float32", sp.PACKED, False), ("float32", sp.BLOCKED, False),
         ("int8", sp.DEFAULT, True), ("int4", sp.DEFAULT, True)]


def asked(*args, **kwargs):
    raise AssertionError("a call decided at the call what its model bound once")


def model(fmt: str, rows: sp.ShortRows, invariant: bool) -> FastModel:
    hf = tiny_model("llama", seed=7, **SHAPE)
    if fmt != "float32":
        hf = wf.packed_copy(hf, WeightFormat.parse(fmt))
    fast = FastModel(hf, max_len=64)
    fast.row_attention, fast.short_rows = invariant, rows
    return fast


@pytest.mark.parametrize("fmt, rows, invariant", CASES, ids=[f"{f}-{r.describe()}-{i}" for f, r, i in CASES])
def test_an_eager_pass_asks_nothing_its_model_bound(fmt, rows, invariant, monkeypatch):
    fast = model(fmt, rows, invariant)
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(8))
    want = every_kind_of_pass(fast, ids)
    fast.reset()
    monkeypatch.setattr(torch.compiler, "is_compiling", asked)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(asked))
    assert torch.equal(every_kind_of_pass(fast, ids), want)


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
def test_a_traced_pass_asks_nothing_and_calls_only_operators(fmt, monkeypatch):
    """The traced plan (FastModel._traced_run: `_operators`, `_traced_calls`) traces whole, and the
    graph gives what the same plan gives run eagerly (dynamo's eager backend: the tracing, not
    inductor's arithmetic, is what is checked)."""
    fast = model(fmt, sp.PACKED if fmt == "float32" else sp.DEFAULT, True)
    ids = torch.randint(3, 256, (4,), generator=torch.Generator().manual_seed(9))
    args = (ids, torch.arange(4), torch.arange(4), fast.max_len)
    want = fast._traced_run(*args)
    monkeypatch.setattr(torch.compiler, "is_compiling", asked)
    traced = torch.compile(fast._traced_run, backend="eager", fullgraph=True)
    assert torch.equal(traced(*args), want)
    assert torch.equal(fast._traced_run(*args), want)


def test_a_packed_layer_binds_its_calls_with_its_kernel():
    """The eager calls are the short product's where one is bound, the operators' where none is;
    the traced ones always the operators'; bound again when the kernel is turned off."""
    packed = wf._pack(torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16), "int8")
    assert packed._traced == packed._operators and packed._traced_add == packed._operators_add
    if packed._short is not None:
        assert packed._eager == packed._short_whole and packed._eager_add == packed._short_whole_add
    packed.bind(packed_kernel=False)
    assert packed._short is None and packed._eager == packed._operators
