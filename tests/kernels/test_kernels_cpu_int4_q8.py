"""viasd_kernels.cpu_int4_q8: int4 and int8 products with the rows quantized to int8 (the AVX2 class's way).

The kernel against its PyTorch reference bit for bit (blocks of 32 and 64, groups of 32 to 256,
zero groups, rounding ties), every row the same in passes of 1 to 16 rows and on 1 or 2 threads (what
keeps `sd` equal to `ar`), its error within the int8 rounding it claims, what it refuses, and which
layers the machine binds it to. It builds where the compiler targets AVX2 and FMA: natively on such a
CPU and, on a CPU above AVX2, under VIASD_MAX_CPU_ISA=avx2; elsewhere (no AVX2: ARM, old x86) the
tests skip with the reason, and under CI on x86-64 they must run.
"""

from __future__ import annotations

import pytest
import torch
from support.avx2_class import built_or_skip, enter_avx2
from support.int4_cases import case, pack
from support.row_checks import rows_alone_equal
from viasd_kernels import cpu_int4_q8 as q8, cpu_packed_mm as pm, instruction_set

bits = lambda t: t.view(torch.int16)  # noqa: E731


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels-q8")


@pytest.fixture
def avx2(folder, monkeypatch):
    """A build folder whose kernels are built for the AVX2 class (the cap where this CPU is above it)."""
    enter_avx2(monkeypatch)
    built_or_skip(q8.functions(folder) is not None, "the int8-activation kernel", q8.why_not(folder))
    return folder


def rows(m: int, k: int, seed: int, spread: int = 6) -> torch.Tensor:
    """bfloat16 rows whose values span 2^-spread to 2^spread within a group (small values round to few
    levels, or to 0), one group of zeros, one of exact rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-spread, spread + 1, (m, k), generator=g)
    x[min(3, m - 1), :32] = 0  # a = 0: codes 0, d = 0
    ties = torch.tensor([127.0, 2.5, 3.5, -0.5, 1.5, -2.5, 126.5, -126.5])  # a = 127: id = 1, x * id = x
    x[0, 32 : 32 + 8] = ties if k >= 64 else x[0, 32 : 32 + 8]
    x[0, 40:64] = 0.25 if k >= 64 else x[0, 40:64]
    return x.to(torch.bfloat16)


def bound_q8(values: torch.Tensor, sz: torch.Tensor, group: int, block: int, folder):
    return pm.Bound(q8.functions(folder)[block], (pack(values, block), sz), (group,),
                    (pack(values, block), pm.scales_by_block(sz, block)), block=block)


@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("shape", [(64, 32, 32), (192, 576, 32), (128, 1536, 32), (64, 256, 64), (64, 512, 256)],
                         ids=lambda s: "{}x{}g{}".format(*s))
def test_the_kernel_is_its_reference_bit_for_bit_in_every_pass(avx2, shape, block):
    n, k, group = shape
    for seed, spread in ((1, 0.05), (2, 3.0)):
        values, sz = case(n, k, group, seed, spread)
        bound = bound_q8(values, sz, group, block, avx2)
        x = rows(16, k, seed)
        want = q8.int4_mm_q8_reference(x, values, group, sz)
        assert torch.equal(bits(bound(x)), bits(want)), (shape, seed)
        alone = rows_alone_equal(bound, x, widths=(1, 2, 3, 5, 16))
        assert torch.equal(bits(alone), bits(want))


def test_the_reference_rounds_ties_to_even_and_zero_groups_to_zero():
    """The quantization's edge cases, where a kernel rounding half away from zero, or dividing by a
    zero maximum, would differ."""
    x = torch.zeros(1, 64)
    x[0, :8] = torch.tensor([127.0, 2.5, 3.5, -0.5, 1.5, -2.5, 126.5, -126.5])
    codes, d, big_x = q8.quantize_rows_reference(x.to(torch.bfloat16), 32)
    assert codes[0, :8].tolist() == [127, 2, 4, 0, 2, -2, 126, -126]
    assert codes[0, 32:].abs().sum() == 0 and d[0, 1] == 0 and big_x[0, 1] == 0
    assert d[0, 0] == torch.tensor(127.0) / 127 and big_x[0, 0] == 127 + 2.5 + 3.5 - 0.5 + 1.5 - 2.5


def test_its_error_is_the_int8_rounding_it_claims(avx2):
    """Against the exact float64 product: each output within half a code step of each input times the
    weight's magnitudes (plus bfloat16's rounding), and not the float32 products' numbers (those round
    only in float32 and bfloat16)."""
    n, k, group = 192, 576, 32
    values, sz = case(n, k, group, 3, 0.05)
    x = rows(16, k, 3)
    got = bound_q8(values, sz, group, 32, avx2)(x).double()
    exact = pm.int4_mm_reference(x, values, group, sz)
    _, d, _ = q8.quantize_rows_reference(x, group)
    w = (values.double() - 8).view(n, k // group, group).abs().sum(-1) * sz[..., 0].double().abs().T  # [N, groups]
    bound = (d.double() / 2) @ w.T * 1.001 + exact.abs() * 2.0**-8 + 1e-30
    assert ((got - exact).abs() <= bound).all()
    portable = pm.int4_mm_portable_reference(x, values, group, sz).double()
    assert (got != portable).float().mean() > 0.3
    assert (got - exact).abs().mean() > (portable - exact).abs().mean()


def test_what_it_does_not_take_is_refused(avx2):
    values, sz = case(64, 96, 32, 1)
    fn = q8.functions(avx2)[32]
    x = rows(2, 96, 1)
    out = torch.empty(2, 64, dtype=torch.bfloat16)
    qdata, by_block = pack(values, 32), pm.scales_by_block(sz, 32)
    call = lambda m, n, k, g: fn(x.data_ptr(), qdata.data_ptr(), by_block.data_ptr(), m, n, k, g, out.data_ptr(), None, 1)  # noqa: E731
    assert call(2, 64, 96, 32) == 0
    assert call(2, 64, 96, 48) == -1  # a group not a multiple of 32
    assert call(2, 48, 96, 32) == -1  # outputs not whole blocks
    assert call(17, 64, 96, 32) == -1  # more rows than a short pass
    assert call(2, 64, 80, 32) == -1  # inputs not whole groups


def test_the_avx2_class_binds_it_to_groups_of_32_and_the_portable_way_elsewhere(avx2):
    values, sz = case(64, 160, 32, 2)
    x = rows(4, 160, 2)
    assert pm.int4_way(avx2) == q8.WAY and pm.way(avx2) == pm.PORTABLE_WAY
    bound = pm.bind_int4(pack(values, 32), 32, sz, 32, build_dir=avx2)
    assert torch.equal(bits(bound(x)), bits(q8.int4_mm_q8_reference(x, values, 32, sz)))
    plain = pm.bind_int4(pack(values, 32), 32, sz, 32, build_dir=avx2, int8_activations=False)
    assert torch.equal(bits(plain(x)), bits(pm.int4_mm_portable_reference(x, values, 32, sz)))
    v40, s40 = case(64, 160, 40, 2)  # a group the kernel does not take: the portable way's
    b40 = pm.bind_int4(pack(v40, 32), 40, s40, 32, build_dir=avx2)
    assert torch.equal(bits(b40(x)), bits(pm.int4_mm_portable_reference(x, v40, 40, s40)))


def test_classes_above_avx2_do_not_bind_it(tmp_path, monkeypatch):
    """The AVX-512 classes keep their own int4 products (the BF16 way, or the 16-lane portable one)."""
    own = instruction_set.cpu_isa_class()
    if own not in ("avx512", "avx512_bf16"):
        pytest.skip(f"this CPU's class is {own}: nothing above AVX2 to build")
    monkeypatch.delenv(instruction_set.ISA_ENV, raising=False)
    if own == "avx512_bf16":
        monkeypatch.setenv(instruction_set.ISA_ENV, "avx512")
    assert pm.available(tmp_path) and pm.int4_way(tmp_path) == pm.way(tmp_path) != q8.WAY


@pytest.mark.parametrize("shape", [(4, 32), (130, 576), (49, 96), (64, 1536)], ids=lambda s: "{}x{}".format(*s))
def test_the_int8_weights_product_is_its_reference_bit_for_bit_in_every_pass(avx2, shape):
    """Output counts off the tiles of 4 included; weights of -128 (|w| = 128 as an unsigned byte)."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    qdata = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    qdata[0, :8] = -128
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    bound = pm.Bound(q8.int8_function(avx2), (qdata, scale), (), k8=(None, 32))
    x = rows(16, k, n)
    want = q8.int8_mm_q8_reference(x, qdata, scale)
    assert torch.equal(bits(bound(x)), bits(want)), shape
    assert torch.equal(bits(rows_alone_equal(bound, x, widths=(1, 2, 5, 16))), bits(want))
    exact = pm.int8_mm_reference(x, qdata, scale)
    _, d, _ = q8.quantize_rows_reference(x, 32)
    w = qdata.double().abs().view(n, k // 32, 32).sum(-1) * scale.double()[:, None]  # [N, groups]
    assert ((bound(x).double() - exact).abs() <= (d.double() / 2) @ w.T * 1.001 + exact.abs() * 2.0**-8 + 1e-30).all()


def test_the_int8_weights_product_binds_in_the_avx2_class_where_k_is_a_multiple_of_32(avx2):
    g = torch.Generator().manual_seed(3)
    qdata = torch.randint(-128, 128, (40, 96), generator=g, dtype=torch.int8)
    scale = (torch.rand(40, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    x = rows(3, 96, 3)
    bound = pm.bind_int8(qdata, scale, build_dir=avx2)
    assert bound.chunks and torch.equal(bits(bound(x)), bits(q8.int8_mm_q8_reference(x, qdata, scale)))
    plain = pm.bind_int8(qdata, scale, build_dir=avx2, int8_activations=False)
    assert not plain.chunks and not torch.equal(bits(plain(x)), bits(bound(x)))
    odd = pm.bind_int8(qdata[:, :48].contiguous(), scale, build_dir=avx2)  # 48 inputs: the portable way's
    assert not odd.chunks
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    fn = q8.int8_function(avx2)
    assert fn(x.data_ptr(), qdata.data_ptr(), scale.data_ptr(), 3, 40, 96, out.data_ptr(), None, 1) == 0
    assert fn(x.data_ptr(), qdata.data_ptr(), scale.data_ptr(), 3, 40, 80, out.data_ptr(), None, 1) == -1
    assert fn(x.data_ptr(), qdata.data_ptr(), scale.data_ptr(), 17, 40, 96, out.data_ptr(), None, 1) == -1
