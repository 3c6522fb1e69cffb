"""viasd_kernels.cpu_packed_mm: a CPU's short passes over int4 and int8 weights.

Each product against its float64 reference (the sums it claims, before its one rounding to
bfloat16), every row bit for bit the same in passes of 1 to 16 rows and on 1 or 2 threads (what
keeps `sd` equal to `ar`), what it refuses, the packed layers that take it (short passes through
the kernel, prefill chunks dense, PyTorch's kernels where it does not run) and greedy `sd` equal to
`ar` through it on a tiny model.

The kernels need AVX-512 BF16: on a CPU without it they do not run (the engine keeps PyTorch's
kernels, which the other int8/int4 tests cover) and these tests skip, saying so; a kernel that does
not build on a CPU that has it fails them under CI.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_kernels_cpu_int4_widen import case, pack
from viasd_kernels import cpu_build, cpu_packed_mm as pm

from viasd_core.decoding import weight_formats as wf

NO_BF16 = "this CPU has no AVX-512 BF16 instructions"


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels")
    if not pm.available(path):
        why = pm.why_not(path)
        if why != NO_BF16:
            assert not os.environ.get("CI"), f"the packed-product kernels must build in CI: {why}"
        pytest.skip(f"the packed-product kernels do not run here: {why}")
    return path


def int4_case(n: int, k: int, group: int, seed: int, spread: float = 0.05):
    values, sz = case(n, k, group, seed, spread)
    return values, pack(values, pm.BLOCK), sz


def rounding_bound(ref: torch.Tensor, abs_products: torch.Tensor) -> torch.Tensor:
    """Half a bfloat16 step of the result, plus float32 accumulation over the products' magnitudes."""
    return ref.abs() * 2.0**-8 + abs_products * 2.0**-18 + 1e-30


ROWS = (1, 2, 3, 4, 5, 6, 8, 16)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """bfloat16 rows whose values span 2^-12 to 2^12, so that float32 sums of their products round
    (and a change of summation order shows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0 ** torch.randint(-12, 13, (rows, k), generator=g)
    return x.to(torch.bfloat16)


def residual_added(bound, x: torch.Tensor) -> None:
    """`bound(x, residual)` is bit for bit PyTorch's `residual + bound(x)` (2-D and 3-D rows), and a
    residual of another shape, dtype or layout is refused."""
    for m in (1, 6, x.shape[0]):
        rows = x[:m].contiguous()
        residual = activations(m, bound.n, seed=m)
        assert torch.equal(bound(rows, residual), residual + bound(rows)), m
        assert torch.equal(bound(rows[None], residual[None]), (residual + bound(rows))[None]), m
    for bad in (residual[:, :-1].contiguous(), residual.float(), residual.t().contiguous().t()):
        if bad.shape != residual.shape or bad.dtype != residual.dtype or not bad.is_contiguous():
            with pytest.raises(ValueError, match="residual"):
                bound(rows, bad)


def rows_alone_equal(bound, x: torch.Tensor) -> None:
    """Every row of x through `bound` is bit for bit the row computed alone on one thread, in passes
    of each width in ROWS (from both ends of x) and on 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([bound(x[i : i + 1].contiguous()) for i in range(x.shape[0])])
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in ROWS:
                assert torch.equal(bound(x[:m].contiguous()), alone[:m]), (m, t)
                assert torch.equal(bound(x[-m:].contiguous()), alone[-m:]), (m, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(64, 32, 32), (192, 576, 32), (128, 1536, 32), (64, 256, 64), (64, 512, 256),
                                   (64, 48, 16), (64, 120, 40)], ids=lambda s: "{}x{}g{}".format(*s))
def test_int4_is_its_reference_and_rows_do_not_depend_on_the_pass(build_dir, shape):
    n, k, group = shape
    for seed, spread in ((1, 0.05), (2, 3.0), (3, 1e-4)):
        values, qdata, sz = int4_case(n, k, group, seed, spread)
        bound = pm.bind_int4(qdata, group, sz, pm.BLOCK, build_dir=build_dir)
        assert bound is not None
        x = activations(16, k, seed)
        got = bound(x)
        assert got.dtype == torch.bfloat16 and got.shape == (16, n)
        ref = pm.int4_mm_reference(x, values, group, sz)
        scale, zero = sz.double().permute(2, 1, 0)
        w = (values.double() - 8).view(n, k // group, group) * scale[..., None] + zero[..., None]
        assert torch.allclose(ref, x.double() @ w.view(n, k).T, rtol=1e-9, atol=1e-12)  # the sums it claims
        magnitude = (x.double().abs() @ w.view(n, k).abs().T)
        assert ((got.double() - ref).abs() <= rounding_bound(ref, magnitude)).all(), (shape, seed)
        rows_alone_equal(bound, x)
        residual_added(bound, x)


@pytest.mark.parametrize("shape", [(4, 32), (192, 576), (1000, 96), (7, 1536), (130, 8192)], ids=lambda s: "{}x{}".format(*s))
def test_int8_is_its_reference_and_rows_do_not_depend_on_the_pass(build_dir, shape):
    """Output counts that are not a multiple of the 4 widened together included."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    qdata = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    bound = pm.bind_int8(qdata, scale, build_dir=build_dir)
    assert bound is not None
    x = activations(16, k, n)
    got = bound(x)
    ref = pm.int8_mm_reference(x, qdata, scale)
    magnitude = (x.double().abs() @ qdata.double().abs().T) * scale.double()
    assert ((got.double() - ref).abs() <= rounding_bound(ref, magnitude)).all(), shape
    rows_alone_equal(bound, x)
    residual_added(bound, x)


def test_int4_scales_are_read_block_by_block(build_dir):
    """The kernel reads a copy of the scales with each block's groups together; the layer's own
    tensors stay what it was bound to (PackedLinear binds again when they are replaced)."""
    values, qdata, sz = int4_case(192, 128, 32, seed=5)
    by_block = pm.scales_by_block(sz, pm.BLOCK)
    assert by_block.shape == (3, 4, 64, 2) and by_block.is_contiguous()
    for b in range(3):
        for g in range(4):
            assert torch.equal(by_block[b, g], sz[g, b * 64 : (b + 1) * 64])
    bound = pm.bind_int4(qdata, 32, sz, 64, build_dir=build_dir)
    assert bound.weights[1] is sz and torch.equal(bound.reads[1], by_block)
    assert bound.ptrs == (qdata.data_ptr(), bound.reads[1].data_ptr())


def test_what_it_does_not_take_is_refused(build_dir):
    values, qdata, sz = int4_case(128, 64, 32, seed=4)
    bd = build_dir
    assert pm.bind_int4(qdata, 32, sz, 32, build_dir=bd) is None  # PyTorch's AVX2 layout (blocks of 32)
    assert pm.bind_int4(qdata[:96], 32, sz[:, :96].contiguous(), 64, build_dir=bd) is None  # a partial block
    assert pm.bind_int4(qdata.to(torch.int16), 32, sz, 64, build_dir=bd) is None  # not packed bytes
    assert pm.bind_int4(qdata, 32, sz.float(), 64, build_dir=bd) is None  # scales not bfloat16
    assert pm.bind_int4(qdata, 32, sz[:, :64], 64, build_dir=bd) is None  # scales of another weight
    assert pm.bind_int4(qdata, 512, sz, 64, build_dir=bd) is None  # a group wider than the weight
    assert pm.bind_int4(qdata, 32, sz, 64, build_dir=bd) is not None
    q8 = torch.zeros(8, 64, dtype=torch.int8)
    s8 = torch.ones(8, dtype=torch.bfloat16)
    assert pm.bind_int8(q8[:, :48].contiguous(), s8, build_dir=bd) is None  # inputs not a multiple of 32
    assert pm.bind_int8(torch.zeros(8, 8224, dtype=torch.int8), s8, build_dir=bd) is None  # wider than MAX_K8
    assert pm.bind_int8(q8, s8.float(), build_dir=bd) is None  # scale not bfloat16
    assert pm.bind_int8(q8, s8[:4], build_dir=bd) is None  # scales of another weight
    assert pm.bind_int8(q8[:, ::2], s8, build_dir=bd) is None  # not contiguous
    assert pm.bind_int8(q8, s8, build_dir=bd) is not None


def test_no_compiler_means_no_kernel_and_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    folder = tmp_path / "none"
    assert not pm.available(folder) and "no C compiler" in pm.why_not(folder)
    values, qdata, sz = int4_case(64, 32, 32, seed=5)
    assert pm.bind_int4(qdata, 32, sz, 64, build_dir=folder) is None


needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")


@needs_torchao
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_packed_layer_takes_the_kernel_for_short_passes_only(build_dir, monkeypatch, kind):
    """Passes of up to 16 rows run the kernel bound to the layer, bit for bit; prefill chunks run one
    dense product (within rounding of the kernel); with the kernel off, PyTorch's kernel."""
    monkeypatch.setattr(wf.paths, "kernel_dir", lambda: build_dir)
    layer = torch.nn.Linear(576, 192, bias=True).to(torch.bfloat16)
    packed = wf._pack(layer, kind)
    bound = packed._short_product(packed.qdata, packed.scale)
    assert isinstance(bound, pm.Bound)
    calls = []
    real = pm.Bound.__call__
    monkeypatch.setattr(pm.Bound, "__call__",
                        lambda self, x, *r: calls.append(x.numel() // x.shape[-1]) or real(self, x, *r))
    torch.manual_seed(0)
    for rows in (1, 6, 16, 17, 40):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        calls.clear()
        got = packed(x)
        assert calls == ([rows] if rows <= pm.MAX_ROWS else []), rows
        want = torch.cat([real(bound, x[i : i + pm.MAX_ROWS].contiguous()) for i in range(0, rows, pm.MAX_ROWS)])
        want = want + packed.bias
        if rows <= pm.MAX_ROWS:
            assert torch.equal(got, want), rows
        else:  # the dense product rounds its own way
            assert ((got.float() - want.float()).abs() <= 0.02 * want.float().abs() + 0.02).all(), rows
        residual = torch.randn(rows, 192).to(torch.bfloat16)
        assert torch.equal(packed.add_to(x, residual), residual + got), rows  # a bias: PyTorch adds both
    # without a bias the short passes add the residual inside the kernel's call, bit for bit
    packed.bias = None
    for rows in (1, 6, 40):
        x, residual = torch.randn(1, rows, 576).to(torch.bfloat16), torch.randn(1, rows, 192).to(torch.bfloat16)
        calls.clear()
        assert torch.equal(packed.add_to(x, residual), residual + packed(x)), rows
        assert calls == ([rows, rows] if rows <= pm.MAX_ROWS else []), rows
    monkeypatch.setattr(wf, "PACKED_KERNEL", False)
    packed._short = None
    x = torch.randn(6, 576).to(torch.bfloat16)
    reference = wf._int4_mm(x, packed.qdata, packed.group, packed.scale) if kind == "int4" else \
        wf._int8_mm_reference(x, packed.qdata, packed.scale)
    assert torch.equal(packed(x), reference)


@needs_torchao
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_greedy_sd_equals_ar_through_the_kernel(build_dir, monkeypatch, fmt):
    """A tiny llama whose projections the kernel takes: every verify block runs through it, and
    greedy sd / exact give ar's tokens."""
    from test_weight_formats import engine, greedy_modes_equal_ar, quantized

    monkeypatch.setattr(wf.paths, "kernel_dir", lambda: build_dir)
    rows = []
    real = pm.Bound.__call__
    monkeypatch.setattr(pm.Bound, "__call__",
                        lambda self, x, *r: rows.append(x.numel() // x.shape[-1]) or real(self, x, *r))
    ar = greedy_modes_equal_ar(engine(quantized("llama", fmt)), [5, 17, 33, 11, 64, 80])
    assert len(ar.tokens) == 40
    assert 1 in rows and max(rows) > 1  # 1-token passes and verify blocks both took it
