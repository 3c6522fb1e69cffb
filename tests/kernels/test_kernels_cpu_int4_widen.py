"""viasd_kernels.cpu_int4_widen: an int4 weight widened to bfloat16 in one pass is bit for bit what
PyTorch's operators make of it (packed_cpu._int4_dense_reference), in both of PyTorch's CPU
layouts and at every group size the kernel takes; what it does not take falls back."""

from __future__ import annotations

import os

import pytest
import torch
from viasd_kernels import cpu_flags, cpu_int4_widen as cw

from support.int4_cases import case, pack
from viasd_core.runtime import packed_cpu, weight_formats as wf


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels")
    values, sz = case(64, 32, 32, seed=0)
    if cw.widen(pack(values, 64), 32, sz, 64, build_dir=path) is None:
        assert not os.environ.get("CI"), f"the int4 widening kernel must build in CI: {cw.why_not()}"
        pytest.skip(f"the int4 widening kernel cannot be built here: {cw.why_not()}")
    return path


@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("shape", [(64, 32, 32), (192, 576, 32), (128, 1536, 32), (64, 256, 64), (32 * 6, 512, 128),
                                   (64, 512, 256), (64, 48, 16), (64, 120, 40)], ids=lambda s: "{}x{}g{}".format(*s))
def test_kernel_is_the_operators_bit_for_bit(build_dir, block, shape):
    """Groups under 32 inputs or not a multiple of 32 go through the plain C loop (every group on a
    CPU without AVX-512 BW): both paths are checked here."""
    n, k, group = shape
    for seed, spread in ((1, 0.05), (2, 3.0), (3, 1e-4)):
        values, sz = case(n, k, group, seed, spread)
        qdata = pack(values, block)
        got = cw.widen(qdata, group, sz, block, build_dir=build_dir)
        want = packed_cpu._int4_dense_reference(qdata, group, sz, block).to(torch.bfloat16)
        assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, want), (shape, block, seed)
        # and the reference is the arithmetic it claims: q * scale + (zero - 8 * scale) in float32
        scale, zero = sz.float().permute(2, 1, 0)
        per_group = values.float().view(n, k // group, group) * scale[..., None] + (zero - 8 * scale)[..., None]
        assert torch.equal(want, per_group.view(n, k).to(torch.bfloat16))


def test_a_packed_layer_widens_through_the_kernel_to_the_same_weight(build_dir, monkeypatch):
    """PackedLinear.widened (a prefill's dense product) takes the kernel where it runs, and gives
    the weight the operators give."""
    layer = torch.nn.Sequential(torch.nn.Linear(576, 192, bias=False).to(torch.bfloat16))
    packed = wf._pack(layer[0], "int4")
    calls = []
    real = cw.widen
    monkeypatch.setattr(cw, "widen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fast = packed.widened(torch.bfloat16)
    assert calls and fast is not None
    monkeypatch.setattr(cw, "widen", lambda *a, **kw: None)  # no kernel here: the operators
    assert torch.equal(fast, packed.widened(torch.bfloat16))


def test_what_it_does_not_take_is_refused(build_dir):
    values, sz = case(128, 64, 32, seed=4)
    qdata = pack(values, 64)
    assert cw.widen(qdata.to(torch.int16), 32, sz, 64, build_dir=build_dir) is None  # not packed bytes
    assert cw.widen(qdata, 32, sz.float(), 64, build_dir=build_dir) is None  # scales not bfloat16
    assert cw.widen(qdata, 32, sz[:, :64], 64, build_dir=build_dir) is None  # scales of another weight
    assert cw.widen(qdata, 32, sz, 128, build_dir=build_dir) is None  # a block the C file does not take
    assert cw.widen(qdata, 512, sz, 64, build_dir=build_dir) is None  # a group wider than the weight


def test_no_compiler_means_no_kernel_and_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_flags, "compiler", lambda: None)
    values, sz = case(64, 32, 32, seed=5)
    assert cw.widen(pack(values, 64), 32, sz, 64, build_dir=tmp_path / "none") is None
    assert "no C compiler" in cw.why_not()
