"""viasd_kernels.cpu_packed_mm: a CPU's short passes over int4 and int8 weights.

Each product against its float64 reference (the sums it claims, before its one rounding to
bfloat16), every row bit for bit the same in passes of 1 to 16 rows and on 1 or 2 threads (what
keeps `sd` equal to `ar`), what it refuses, the packed layers that take it (short passes through
the kernel, prefill chunks dense, PyTorch's kernels where it does not run) and greedy `sd` equal to
`ar` through it on a tiny model.

Each way is tested where it runs: "native" is the way this CPU runs uncapped (AVX-512 BF16 where the
CPU has it, else the portable one); "avx2" and "avx512" build the kernels under VIASD_MAX_CPU_ISA (a
build folder per cap), which runs the portable way on a CPU above that class, so the portable way is
tested on this CPU whatever its class (on a CPU at or below the cap these skip: "native" is that way).
A kernel that does not build fails them under CI.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.row_checks import rows_alone_equal
from conftest import needs_torchao
from support.int4_cases import case, pack
from viasd_kernels import cpu_flags, cpu_packed_mm as pm, instruction_set

from viasd_core.runtime import packed_cpu, packed_torch, weight_formats as wf

NO_BF16 = "this CPU has no AVX-512 BF16 instructions"
WAYS = ("native", "avx2", "avx512")


def above(cap: str) -> bool:
    """Whether this CPU's own class is above `cap` (the cap then changes what is built)."""
    own = instruction_set.cpu_isa_class()
    return own in instruction_set.ISA_CLASSES and instruction_set.ISA_CLASSES.index(own) > instruction_set.ISA_CLASSES.index(cap)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {way: tmp_path_factory.mktemp(f"kernels-{way}") for way in WAYS}


def enter(way: str, folders, monkeypatch):
    """The build folder of `way`, with the cap in force for the test (skip where it changes nothing)."""
    monkeypatch.delenv(instruction_set.ISA_ENV, raising=False)
    if way != "native":
        if not above(way):
            pytest.skip(f"this CPU's class ({instruction_set.cpu_isa_class()}) is not above {way}: 'native' is its way")
        monkeypatch.setenv(instruction_set.ISA_ENV, way)
    path = folders[way]
    if not pm.available(path):
        why = pm.why_not(path)
        assert not os.environ.get("CI"), f"the packed-product kernels must build in CI: {why}"
        pytest.skip(f"the packed-product kernels do not run here: {why}")
    return path


@pytest.fixture(params=WAYS)
def kernels(request, folders, monkeypatch):
    """(way, build folder) for each way that runs here."""
    return request.param, enter(request.param, folders, monkeypatch)


@pytest.fixture
def build_dir(folders, monkeypatch):
    """The native way's build folder."""
    return enter("native", folders, monkeypatch)


def int4_case(n: int, k: int, group: int, seed: int, spread: float = 0.05, block: int = pm.BLOCK):
    values, sz = case(n, k, group, seed, spread)
    return values, pack(values, block), sz


def rounding_bound(ref: torch.Tensor, abs_products: torch.Tensor) -> torch.Tensor:
    """Half a bfloat16 step of the result, plus float32 accumulation over the products' magnitudes."""
    return ref.abs() * 2.0**-8 + abs_products * 2.0**-18 + 1e-30


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


@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("shape", [(64, 32, 32), (192, 576, 32), (128, 1536, 32), (64, 256, 64), (64, 512, 256),
                                   (64, 48, 16), (64, 120, 40)], ids=lambda s: "{}x{}g{}".format(*s))
def test_int4_is_its_reference_and_rows_do_not_depend_on_the_pass(kernels, shape, block):
    """Both of PyTorch's CPU layouts (blocks of 64, AVX-512's; of 32, AVX2's) where the way takes them."""
    way, folder = kernels
    n, k, group = shape
    if block not in (pm.PORTABLE_BLOCKS if pm.way(folder) != pm.BF16_WAY else (pm.BLOCK,)):
        values, qdata, sz = int4_case(n, k, group, 1, block=block)
        assert pm.bind_int4(qdata, group, sz, block, build_dir=folder) is None
        return
    for seed, spread in ((1, 0.05), (2, 3.0), (3, 1e-4)):
        values, qdata, sz = int4_case(n, k, group, seed, spread, block)
        # the float32 products (the AVX2 class's int8-activation ones: test_kernels_cpu_int4_q8.py)
        bound = pm.bind_int4(qdata, group, sz, block, build_dir=folder, int8_activations=False)
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


@pytest.mark.parametrize("shape", [(4, 32), (192, 576), (1000, 96), (7, 1536), (130, 8192), (9, 8224), (5, 48)],
                         ids=lambda s: "{}x{}".format(*s))
def test_int8_is_its_reference_and_rows_do_not_depend_on_the_pass(kernels, shape):
    """Output counts that are not a multiple of the outputs widened together included; inputs past
    MAX_K8 or not a multiple of 32 only where the way takes them (the portable one)."""
    way, folder = kernels
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    qdata = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    # the float32 products (the AVX2 class's int8-activation ones: test_kernels_cpu_int4_q8.py)
    bound = pm.bind_int8(qdata, scale, build_dir=folder, int8_activations=False)
    if pm.way(folder) == pm.BF16_WAY and (k % 32 or k > pm.MAX_K8):
        assert bound is None
        return
    assert bound is not None
    x = activations(16, k, n)
    got = bound(x)
    ref = pm.int8_mm_reference(x, qdata, scale)
    magnitude = (x.double().abs() @ qdata.double().abs().T) * scale.double()
    assert ((got.double() - ref).abs() <= rounding_bound(ref, magnitude)).all(), shape
    rows_alone_equal(bound, x)
    residual_added(bound, x)


def grouped_case(n: int, k: int, seed: int):
    """An int8 weight [n, k] with a float16 scale (held in float32) for each group of 32 inputs, the
    scales spread over 2^-10 .. 2^2 so that a scale read for the wrong group shows (GGUF's Q8_0)."""
    g = torch.Generator().manual_seed(seed)
    qdata = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // pm.GROUP8, generator=g) * 2.0 ** torch.randint(-10, 3, (n, k // pm.GROUP8), generator=g))
    return qdata, scales.half().float()


@pytest.mark.parametrize("shape", [(4, 32), (192, 576), (1000, 96), (7, 1536), (130, 8192), (9, 8224)],
                         ids=lambda s: "{}x{}".format(*s))
def test_int8_by_groups_is_its_reference_and_rows_do_not_depend_on_the_pass(kernels, shape):
    """bind_int8g (the GGUF Q8_0 output head): float32 outputs within float32 accumulation of the
    float64 sums of each group times its scale, bit for bit the same row in every pass width and
    thread count, the residual added as PyTorch adds it; inputs past MAX_K8 only in the portable way."""
    way, folder = kernels
    n, k = shape
    qdata, scales = grouped_case(n, k, n + k)
    bound = pm.bind_int8g(qdata, scales, build_dir=folder)
    if pm.way(folder) == pm.BF16_WAY and k > pm.MAX_K8:
        assert bound is None
        return
    assert bound is not None and bound.out_dtype is torch.float32
    x = activations(16, k, n)
    got = bound(x)
    assert got.dtype == torch.float32 and got.shape == (16, n)
    ref = pm.int8g_mm_reference(x, qdata, scales)
    w = qdata.double().view(n, k // 32, 32) * scales.double()[..., None]
    assert torch.allclose(ref, x.double() @ w.view(n, k).T, rtol=1e-9, atol=1e-12)  # the sums it claims
    magnitude = x.double().abs() @ w.view(n, k).abs().T
    assert ((got.double() - ref).abs() <= magnitude * 2.0**-17 + 1e-30).all(), shape
    if k > 32:  # one scale a row (the first group's) is not these sums
        one_scale = pm.int8_mm_reference(x, qdata, scales[:, 0])
        assert ((got.double() - one_scale).abs() > magnitude * 2.0**-17).any()
    rows_alone_equal(bound, x)
    residual = torch.randn(16, n)
    assert torch.equal(bound(x, residual), residual + got)
    with pytest.raises(ValueError, match="residual"):
        bound(x, residual.to(torch.bfloat16))


def test_int8_by_groups_refuses_what_it_does_not_take(kernels):
    way, bd = kernels
    qdata, scales = grouped_case(8, 64, 5)
    assert pm.bind_int8g(qdata, scales, build_dir=bd) is not None
    assert pm.bind_int8g(qdata, scales.to(torch.bfloat16), build_dir=bd) is None  # scales not float32
    assert pm.bind_int8g(qdata, scales[:, :1].contiguous(), build_dir=bd) is None  # one scale a row
    assert pm.bind_int8g(qdata[:, :48].contiguous(), scales[:, :1].contiguous(), build_dir=bd) is None  # 48 inputs
    assert pm.bind_int8g(qdata, scales.t().contiguous().t(), build_dir=bd) is None  # not contiguous
    assert pm.bind_int8g(qdata.to(torch.int16), scales, build_dir=bd) is None  # not int8 codes


def test_each_way_says_what_runs(kernels):
    way, folder = kernels
    assert pm.available(folder)
    if way != "native":
        assert pm.way(folder) == pm.PORTABLE_WAY  # this CPU has FMA wherever it is above AVX2
        assert pm.why_not(folder) == f"{instruction_set.ISA_ENV}={way} caps the instruction set below AVX-512 BF16"
        assert pm.ways(folder) == (pm.PORTABLE_WAY,) and pm.way(folder, portable=True) == pm.PORTABLE_WAY
    elif instruction_set.cpu_isa_class() == "avx512_bf16":
        assert pm.way(folder) == pm.BF16_WAY and pm.why_not(folder) is None
        assert pm.ways(folder) == (pm.BF16_WAY, pm.PORTABLE_WAY)  # a machine chooses between the two
        assert pm.way(folder, portable=True) == pm.PORTABLE_WAY and pm.why_not(folder) is None
    else:
        assert pm.way(folder) in (pm.PORTABLE_WAY, pm.PORTABLE_NO_FMA_WAY)
        assert pm.why_not(folder) == NO_BF16 and pm.ways(folder) == (pm.way(folder),)


def test_the_portable_way_gives_the_same_bits_in_every_class_and_layout(folders, monkeypatch):
    """Its int4 lanes are outputs (any vector width, the same operations) and its int8 lanes are folded
    in one tree whatever the width: the AVX2 and AVX-512 builds agree bit for bit, and an int4 weight
    gives the same bits in blocks of 64 and of 32."""
    if not above("avx512"):
        pytest.skip("this CPU is not above AVX-512 (no BF16): only one portable class builds here")
    values, sz = case(192, 576, 32, seed=7)
    x = activations(16, 576, seed=7)
    g = torch.Generator().manual_seed(7)
    q8 = torch.randint(-128, 128, (130, 576), generator=g, dtype=torch.int8)
    s8 = (torch.rand(130, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    got = {}
    for cap in ("avx2", "avx512"):
        folder = enter(cap, folders, monkeypatch)
        got[cap] = [pm.bind_int4(pack(values, b), 32, sz, b, build_dir=folder, int8_activations=False)(x)
                    for b in pm.PORTABLE_BLOCKS]
        got[cap].append(pm.bind_int8(q8, s8, build_dir=folder, int8_activations=False)(x))
    for a, b in zip(got["avx2"], got["avx512"]):
        assert torch.equal(a, b)
    assert torch.equal(got["avx2"][0], got["avx2"][1])
    # and the portable way is not the BF16 way's arithmetic: its own numbers, not a copy of them
    native = enter("native", folders, monkeypatch)
    assert pm.way(native) == pm.BF16_WAY
    assert not torch.equal(pm.bind_int4(pack(values, 64), 32, sz, 64, build_dir=native)(x), got["avx2"][0])


def cancelling_case(n: int, k: int, group: int, seed: int):
    """Codes, scales and 16 rows whose products and sums cancel in pairs within every group (x' = -x
    against the same code, the pairs' second halves in another order): exactly, every D and X is 0,
    so what the kernel returns is float32's rounding in the order its arithmetic takes, and a kernel
    that summed in any other order, or more exactly, shows in its bfloat16 outputs."""
    g = torch.Generator().manual_seed(seed)
    half = group // 2
    values = torch.randint(0, 16, (n, k // group, half), generator=g)
    order = torch.randperm(half, generator=g)
    values = torch.cat([values, values[..., order]], -1).view(n, k)
    x = activations(16, k, seed).view(16, k // group, group)[..., :half]
    x = torch.cat([x, -x[..., order]], -1).reshape(16, k)
    sz = (torch.randn(k // group, n, 2, generator=g) * 0.05).to(torch.bfloat16)
    return values, sz, x


def mirrored_case(n: int, k: int, group: int, seed: int):
    """Codes, scales and 16 rows whose groups come in pairs that cancel (the second of each pair the
    first's codes and inputs, its scale and zero negated): exactly, each pair adds 0 to every output,
    so what is left is float32's rounding of the running outputs y, in the order and with the fused
    multiply-adds the kernel takes."""
    g = torch.Generator().manual_seed(seed)
    pairs = k // group // 2
    values, sz = case(n, k, group, seed, spread=1.0)
    x = activations(16, k, seed).view(16, k // group, group)
    values = values.view(n, k // group, group)
    values[:, 1 : 2 * pairs : 2], x[:, 1 : 2 * pairs : 2] = values[:, 0 : 2 * pairs : 2], x[:, 0 : 2 * pairs : 2]
    sz[1 : 2 * pairs : 2] = -sz[0 : 2 * pairs : 2]
    return values.reshape(n, k), sz, x.reshape(16, k).contiguous()


@pytest.mark.parametrize("block", [64, 32])
def test_the_portable_int4_way_is_its_reference_bit_for_bit(kernels, block):
    """Every portable build (AVX2's staged widening and paired groups, AVX-512's lookups, the vector
    extensions') returns `int4_mm_portable_reference`'s bits: each output's D in input order, the
    groups in order, rounded once; in passes of every width and on 1 and 2 threads. A build that runs
    the AVX-512 BF16 way builds the portable one beside it, which a machine may choose
    (viasd_core/machine/packed_way.py): that one is tested here as the native way."""
    way, folder = kernels
    portable = pm.way(folder) == pm.BF16_WAY  # the BF16 build's portable products, as packed_way binds them
    fused = pm.way(folder, portable) == pm.PORTABLE_WAY
    bits = lambda t: t.view(torch.int16)
    for n, k, group in ((192, 576, 32), (64, 120, 40), (64, 512, 256), (64, 48, 16)):
        for seed in (1, 2):
            values, sz = case(n, k, group, seed, spread=3.0)
            cases = [(values, sz, activations(16, k, seed)), cancelling_case(n, k, group, seed),
                     mirrored_case(n, k, group, seed)]
            for values, sz, x in cases:
                bound = pm.bind_int4(pack(values, block), group, sz, block, build_dir=folder, int8_activations=False,
                                     portable=portable)
                want = pm.int4_mm_portable_reference(x, values, group, sz, fused)
                assert torch.equal(bits(bound(x)), bits(want)), (n, k, group, seed)
                alone = rows_alone_equal(bound, x, widths=(1, 2, 3, 5, 6, 16))
                assert torch.equal(bits(alone), bits(want))
    # the cancelling rows tell orders apart: the same sums in reverse order, or in float64, differ
    values, sz, x = cancelling_case(192, 576, 32, 3)
    want = pm.int4_mm_portable_reference(x, values, 32, sz, fused)
    backwards = pm.int4_mm_portable_reference(x.flip(-1).contiguous(), values.flip(-1).contiguous(), 32,
                                              sz.flip(0).contiguous(), fused)
    assert (bits(backwards) != bits(want)).float().mean() > 0.5
    assert (bits(pm.int4_mm_reference(x, values, 32, sz).to(torch.bfloat16)) != bits(want)).float().mean() > 0.5
    # and the mirrored groups tell the running outputs' rounding apart: fused multiply-adds or not
    values, sz, x = mirrored_case(192, 576, 32, 3)
    want = pm.int4_mm_portable_reference(x, values, 32, sz, fused)
    other = pm.int4_mm_portable_reference(x, values, 32, sz, not fused)
    assert (bits(other) != bits(want)).float().mean() > 0.5


def test_int4_scales_are_read_block_by_block(kernels):
    """The kernel reads a copy of the scales with each block's groups together; the layer's own
    tensors stay what it was bound to (PackedLinear binds again when they are replaced)."""
    way, folder = kernels
    values, qdata, sz = int4_case(192, 128, 32, seed=5)
    for block in (64, 32):
        by_block = pm.scales_by_block(sz, block)
        assert by_block.shape == (192 // block, 4, block, 2) and by_block.is_contiguous()
        for b in range(192 // block):
            for g in range(4):
                assert torch.equal(by_block[b, g], sz[g, b * block : (b + 1) * block])
    for block in (64, 32) if pm.way(folder) != pm.BF16_WAY else (64,):
        bound = pm.bind_int4(pack(values, block), 32, sz, block, build_dir=folder)
        assert bound.weights[1] is sz and torch.equal(bound.reads[1], pm.scales_by_block(sz, block))
        assert bound.ptrs == (bound.weights[0].data_ptr(), bound.reads[1].data_ptr())
        # storage replaced under it (`.data =`): bound again in the same layout, the new weight's numbers
        x = activations(3, 128, seed=block)
        values2, sz2 = case(192, 128, 32, seed=6)
        bound.weights[0].data = pack(values2, block)
        sz.data = sz2.clone()
        want = pm.bind_int4(pack(values2, block), 32, sz2, block, build_dir=folder)(x)
        assert torch.equal(bound(x), want) and bound.block == block


def test_what_it_does_not_take_is_refused(kernels):
    way, bd = kernels
    portable = pm.way(bd) != pm.BF16_WAY
    values, qdata, sz = int4_case(128, 64, 32, seed=4)
    # PyTorch's AVX2 layout (blocks of 32): the portable way's
    assert (pm.bind_int4(qdata, 32, sz, 32, build_dir=bd) is not None) == portable
    assert pm.bind_int4(qdata, 32, sz, 16, build_dir=bd) is None  # a layout neither takes
    assert pm.bind_int4(qdata, 32, sz, None, build_dir=bd) is None  # a layout PyTorch's probe did not read back
    assert pm.bind_int4(qdata[:96], 32, sz[:, :96].contiguous(), 64, build_dir=bd) is None  # a partial block
    assert (pm.bind_int4(pack(values[:96], 32), 32, sz[:, :96].contiguous(), 32, build_dir=bd) is not None) == portable
    assert pm.bind_int4(qdata.to(torch.int16), 32, sz, 64, build_dir=bd) is None  # not packed bytes
    assert pm.bind_int4(qdata, 32, sz.float(), 64, build_dir=bd) is None  # scales not bfloat16
    assert pm.bind_int4(qdata, 32, sz[:, :64], 64, build_dir=bd) is None  # scales of another weight
    assert pm.bind_int4(qdata, 512, sz, 64, build_dir=bd) is None  # a group wider than the weight
    assert pm.bind_int4(qdata, 32, sz, 64, build_dir=bd) is not None
    q8 = torch.zeros(8, 64, dtype=torch.int8)
    s8 = torch.ones(8, dtype=torch.bfloat16)
    # inputs not a multiple of 32 (the portable way takes multiples of 16), wider than MAX_K8 (it takes any)
    assert (pm.bind_int8(q8[:, :48].contiguous(), s8, build_dir=bd) is not None) == portable
    assert (pm.bind_int8(torch.zeros(8, 8224, dtype=torch.int8), s8, build_dir=bd) is not None) == portable
    assert pm.bind_int8(q8[:, :40].contiguous(), s8, build_dir=bd) is None  # not a multiple of 16
    assert pm.bind_int8(q8, s8.float(), build_dir=bd) is None  # scale not bfloat16
    assert pm.bind_int8(q8, s8[:4], build_dir=bd) is None  # scales of another weight
    assert pm.bind_int8(q8[:, ::2], s8, build_dir=bd) is None  # not contiguous
    assert pm.bind_int8(q8[0], s8[:1], build_dir=bd) is None  # not 2-D
    assert pm.bind_int8(q8, s8, build_dir=bd) is not None


def test_no_compiler_means_no_kernel_and_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_flags, "compiler", lambda: None)
    folder = tmp_path / "none"
    assert not pm.available(folder) and "no C compiler" in pm.why_not(folder)
    values, qdata, sz = int4_case(64, 32, 32, seed=5)
    assert pm.bind_int4(qdata, 32, sz, 64, build_dir=folder) is None




@needs_torchao
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_packed_layer_takes_the_kernel_for_short_passes_only(kernels, monkeypatch, kind):
    """Passes of up to 16 rows run the kernel bound to the layer, bit for bit; prefill chunks run one
    dense product (within rounding of the kernel); with the kernel off, PyTorch's kernel. (Under a
    cap this process's PyTorch still packs int4 in its uncapped layout, which the portable way takes
    too; a process started under the cap packs in blocks of 32: test_row_invariance.py.)"""
    way, build_dir = kernels
    monkeypatch.setattr("viasd_core.paths.kernel_dir", lambda: build_dir)
    layer = torch.nn.Linear(576, 192, bias=True).to(torch.bfloat16)
    packed = wf._pack(layer, kind)
    bound = packed._short_product(packed.qdata, packed.scale)
    assert isinstance(bound, pm.Bound)
    calls, added = [], []  # rows of each call; rows of the calls handed the residual
    real = pm.Bound.__call__
    monkeypatch.setattr(pm.Bound, "__call__", lambda self, x, *r: calls.append(x.numel() // x.shape[-1])
                        or (r and r[0] is not None and added.append(x.numel() // x.shape[-1])) or real(self, x, *r))
    torch.manual_seed(0)
    chunks = lambda rows: [min(pm.MAX_ROWS, rows - i) for i in range(0, rows, pm.MAX_ROWS)]  # noqa: E731
    for rows in (1, 6, 16, 17, 40):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        calls.clear()
        got = packed(x)
        # longer passes: the int8-activation products in chunks of 16 rows (Bound.chunks), else dense
        assert calls == ([rows] if rows <= pm.MAX_ROWS else chunks(rows) if bound.chunks else []), rows
        want = torch.cat([real(bound, x[i : i + pm.MAX_ROWS].contiguous()) for i in range(0, rows, pm.MAX_ROWS)])
        want = want + packed.bias
        if rows <= pm.MAX_ROWS or bound.chunks:
            assert torch.equal(got, want), rows
        else:  # the dense product rounds its own way
            assert ((got.float() - want.float()).abs() <= 0.02 * want.float().abs() + 0.02).all(), rows
        residual = torch.randn(rows, 192).to(torch.bfloat16)
        assert torch.equal(packed.add_to(x, residual), residual + got), rows  # a bias: PyTorch adds both
    # without a bias the short passes add the residual inside the kernel's call, bit for bit
    assert added == []
    packed.bias = None
    packed.bind()  # the layer's calls bound again without a bias
    for rows in (1, 6, 40):
        x, residual = torch.randn(1, rows, 576).to(torch.bfloat16), torch.randn(1, rows, 192).to(torch.bfloat16)
        calls.clear(), added.clear()
        assert torch.equal(packed.add_to(x, residual), residual + packed(x)), rows
        assert calls == ([rows, rows] if rows <= pm.MAX_ROWS else chunks(rows) * 2 if bound.chunks else []), rows
        assert added == ([rows] if rows <= pm.MAX_ROWS else []), rows
    packed.bind(packed_kernel=False)
    x = torch.randn(6, 576).to(torch.bfloat16)
    reference = packed_torch._int4_mm_cpu(x, packed.qdata, packed.group, packed.scale) if kind == "int4" else \
        packed_torch._int8_mm_reference(x, packed.qdata, packed.scale)
    assert torch.equal(packed(x), reference)


def test_an_int8_layer_by_groups_keeps_float32_outputs_on_every_path(kernels, monkeypatch):
    """weight_formats.int8_from_blocks (the GGUF Q8_0 output head): passes of up to 16 rows through
    bind_int8g, bit for bit; longer passes, traced passes and the kernel turned off through the
    exact float32 weight (packed_torch.int8_grouped_mm), never a bfloat16 one; every output float32."""
    way, build_dir = kernels
    monkeypatch.setattr("viasd_core.paths.kernel_dir", lambda: build_dir)
    qdata, scales = grouped_case(192, 576, 3)
    layer = wf.int8_from_blocks(qdata, scales, pm.GROUP8)
    assert layer.grouped and layer.kind == "int8" and "group=32" in repr(layer)
    exact = (qdata.float().view(192, 18, 32) * scales[..., None]).view(192, 576)
    assert torch.equal(layer.widened(torch.float32), exact)
    bound = layer._short_product(layer.qdata, layer.scale)
    assert isinstance(bound, pm.Bound) and bound.out_dtype is torch.float32
    for rows in (1, 6, 16, 17, 40):
        x = activations(rows, 576, rows)
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 192)
        if rows <= pm.MAX_ROWS:
            assert torch.equal(got, bound(x)), rows
        else:
            assert torch.equal(got, torch.nn.functional.linear(x.float(), exact)), rows
        assert torch.equal(layer._traced(x), torch.nn.functional.linear(x.float(), exact)), rows
        residual = torch.randn(rows, 192)
        assert torch.equal(layer.add_to(x, residual), residual + got), rows
    layer.bind(packed_kernel=False)
    x = activations(6, 576, 6)
    assert torch.equal(layer(x), torch.nn.functional.linear(x.float(), exact))


@needs_torchao
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_greedy_sd_equals_ar_through_the_kernel(kernels, monkeypatch, fmt):
    """A tiny llama whose projections the kernel takes: every verify block runs through it, and
    greedy sd / exact give ar's tokens."""
    from support.format_cases import engine, greedy_modes_equal_ar, quantized

    way, build_dir = kernels
    if way == "avx512":
        pytest.skip("the portable way's passes are checked under the avx2 cap (the same bits under avx512)")
    monkeypatch.setattr("viasd_core.paths.kernel_dir", lambda: build_dir)
    rows = []
    real = pm.Bound.__call__
    monkeypatch.setattr(pm.Bound, "__call__",
                        lambda self, x, *r: rows.append(x.numel() // x.shape[-1]) or real(self, x, *r))
    ar = greedy_modes_equal_ar(engine(quantized("llama", fmt)), [5, 17, 33, 11, 64, 80])
    assert len(ar.tokens) == 40
    assert 1 in rows and max(rows) > 1  # 1-token passes and verify blocks both took it
