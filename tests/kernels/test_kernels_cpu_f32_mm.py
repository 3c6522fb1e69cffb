"""viasd_kernels.cpu_f32_mm: a CPU's short passes over float32 weights, row by row the same.

The product against its float64 reference (within float32 rounding), each row bit for bit the row
computed alone in passes of every width from 1 to 16 on 1 and 2 threads (what keeps `sd` equal to
`ar` in float32), the same numbers from a build capped at AVX2 (a CPU without AVX-512), the lanes
added in the documented tree and each step a fused multiply-add (on numbers where only those roundings
happen), the bias and the residual added as PyTorch adds them, and what it refuses (bad rows, a
replaced weight). Changing the tree, turning contraction off, folding the 1-row pass's lanes or the
AVX2 build's another way, or adding the residual before the bias fails them (checked by mutation).
A kernel that does not build fails these tests under CI; elsewhere they skip, saying why.
"""

from __future__ import annotations

import contextlib
import os
import platform

import pytest
import torch
from support.row_checks import rows_alone_equal
from viasd_kernels import cpu_f32_mm as fm, cpu_flags, instruction_set


def built(path):
    if fm.vector_bits(path) is None:
        why = fm.why_not()
        assert not os.environ.get("CI"), f"the float32 product must build in CI: {why}"
        pytest.skip(f"the float32 product does not build here: {why}")
    return path


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return built(tmp_path_factory.mktemp("kernels"))


@contextlib.contextmanager
def avx2_only():
    """Builds (and functions looked up) as for a CPU without AVX-512: the build's instruction-set cap
    where cpu_build has one, else this machine's flags with AVX-512 off (x86-64; elsewhere as built)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        yield
    elif hasattr(instruction_set, "ISA_ENV"):
        before = os.environ.get(instruction_set.ISA_ENV)
        os.environ[instruction_set.ISA_ENV] = "avx2"
        try:
            yield
        finally:
            os.environ.pop(instruction_set.ISA_ENV)
            if before is not None:
                os.environ[instruction_set.ISA_ENV] = before
    else:
        flags = cpu_flags.FLAGS
        cpu_flags.FLAGS = (*flags, "-mno-avx512f")
        try:
            yield
        finally:
            cpu_flags.FLAGS = flags


@pytest.fixture(scope="module")
def avx2_dir(tmp_path_factory):
    """A build folder for the kernel built under `avx2_only` (bind in that context)."""
    path = tmp_path_factory.mktemp("kernels_avx2")
    with avx2_only():
        return built(path)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """float32 rows whose values span 2^-12 to 2^12, so that float32 sums of their products round
    (and a change of summation order shows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * 2.0 ** torch.randint(-12, 13, (rows, k), generator=g).float()


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * k**-0.5


def within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """got is the float64 reference but for float32 rounding: K / 16 fused multiply-adds a lane, 4
    adds across the lanes, the bias, the result's own rounding."""
    ref = fm.f32_mm_reference(x, w, bias)
    magnitude = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    steps = w.shape[1] // fm.LANES + 4 + 2
    bound = magnitude * steps * 2.0**-24 + ref.abs() * 2.0**-24 + 1e-37
    assert ((got.double() - ref).abs() <= bound).all()


# the lm_head, k/v, down shapes of SmolLM2-135M; K not a multiple of 64; N off the output tiles
SHAPES = [(49152, 576), (192, 576), (576, 1536), (1003, 592), (7, 48), (3, 16), (130, 8208)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{}x{}".format(*s))
def test_the_product_is_its_reference_and_rows_do_not_depend_on_the_pass(build_dir, avx2_dir, shape):
    n, k = shape
    w = weights(n, k, seed=n + k)
    x = activations(fm.MAX_ROWS, k, seed=n)
    bound = fm.bind(w, build_dir=build_dir)
    assert bound is not None
    got = bound(x)
    assert got.dtype == torch.float32 and got.shape == (fm.MAX_ROWS, n)
    within_rounding(got, x, w)
    alone = rows_alone_equal(bound, x)
    assert torch.equal(alone, got)
    # built for AVX2 the tiles differ, the numbers do not
    with avx2_only():
        capped = fm.bind(w, build_dir=avx2_dir)
    assert torch.equal(rows_alone_equal(capped, x), got)


def test_the_capped_build_has_no_avx512(build_dir, avx2_dir):
    """The AVX2 build is what it claims (else the test above compares a build with itself)."""
    native = fm.vector_bits(build_dir)
    with avx2_only():
        assert fm.vector_bits(avx2_dir) in (256, 128, 0)
    if "avx512f" in instruction_set.cpu_identity().split():
        assert native == 512


def test_128_bit_tiles_give_the_same_bits(build_dir, tmp_path, monkeypatch):
    """Built for 128-bit vectors (NEON's width; here forced with -DPART_BYTES=16 so that the build keeps
    the CPU's FMA, which SSE2 alone lacks) each accumulator is four registers and the tiles are
    smaller: every row's numbers are the native build's."""
    cases = []
    for n, k in SHAPES:
        w, x = weights(n, k, seed=n + k), activations(fm.MAX_ROWS, k, seed=n)
        cases.append((w, x, fm.bind(w, build_dir=build_dir)(x)))
    monkeypatch.setattr(cpu_flags, "FLAGS", (*cpu_flags.FLAGS, "-DPART_BYTES=16"))
    folder = built(tmp_path / "v128")
    assert fm.vector_bits(folder) == 128
    for w, x, native in cases:
        assert torch.equal(rows_alone_equal(fm.bind(w, build_dir=folder), x), native)


def lane_tree(p: torch.Tensor) -> torch.Tensor:
    """The kernel's sum of 16 float32 lanes [..., 16]: l + l + 8, then l + l + 4, then (0 + 2) + (1 + 3)."""
    s8 = p[..., :8] + p[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


def test_the_lanes_are_added_in_the_documented_order(build_dir, avx2_dir):
    """Products exact in float32 (small integers times powers of two) so that only the adds round:
    16 inputs are one lane each, and the result is `lane_tree` of the products bit for bit (another
    order rounds differently on these numbers: checked). 32 inputs: lane l is one fused multiply-add
    of input l + 16 on input l's product (exact in float64 here), where the CPU has FMA."""
    g = torch.Generator().manual_seed(7)
    m, n = fm.MAX_ROWS, 40
    x = torch.randint(-9, 10, (m, 16), generator=g).float()
    w = 2.0 ** torch.randint(-20, 21, (n, 16), generator=g).float() * torch.randint(1, 8, (n, 16), generator=g)
    products = x[:, None, :] * w[None, :, :]  # [m, n, 16], exact
    want = lane_tree(products)
    assert not torch.equal(want, products.sum(-1)) and not torch.equal(want, products.cumsum(-1)[..., -1])
    with avx2_only():
        capped = fm.bind(w, build_dir=avx2_dir)
    for bound in (fm.bind(w, build_dir=build_dir), capped):
        assert torch.equal(bound(x), want)
        assert torch.equal(torch.cat([bound(x[i : i + 1]) for i in range(m)]), want)
    if "fma" in instruction_set.cpu_identity().split() or platform.machine().lower() in ("aarch64", "arm64"):
        # first products below 2^11 with a few bits, second ones in [1, 4) of 36 bits: the float64 sum is exact
        w1 = 2.0 ** torch.randint(-4, 5, (n, 16), generator=g).float() * torch.randint(1, 8, (n, 16), generator=g)
        x2 = (torch.rand(m, 16, generator=g) * 2**12).floor() / 2**12 + 1
        w2 = torch.rand(n, 16, generator=g) + 1
        first = x[:, None, :] * w1[None, :, :]
        second = x2[:, None, :].double() * w2[None, :, :].double()
        lanes = (second + first.double()).float()  # one rounding, as a fused multiply-add
        assert not torch.equal(lanes, x2[:, None, :] * w2[None, :, :] + first)  # two roundings differ
        xs, ws = torch.cat([x, x2], 1), torch.cat([w1, w2], 1)
        with avx2_only():
            capped = fm.bind(ws, build_dir=avx2_dir)
        for bound in (fm.bind(ws, build_dir=build_dir), capped):
            assert torch.equal(bound(xs), lane_tree(lanes))


def test_bias_and_residual_are_added_as_pytorch_adds_them(build_dir):
    n, k = 300, 576
    w, b = weights(n, k, seed=1), torch.randn(n) * 0.5
    plain, biased = fm.bind(w, build_dir=build_dir), fm.bind(w, b, build_dir=build_dir)
    x = activations(fm.MAX_ROWS, k, seed=2)
    for m in (1, 6, 16):
        rows = x[:m].contiguous()
        residual = activations(m, n, seed=m)
        y = plain(rows)
        assert torch.equal(biased(rows), y + b), m
        assert torch.equal(plain(rows, residual), residual + y), m
        assert torch.equal(biased(rows, residual), residual + (y + b)), m
        assert torch.equal(biased(rows[None], residual[None]), (residual + (y + b))[None]), m  # [1, T, K] rows
    within_rounding(biased(x), x, w, b)
    rows_alone_equal(biased, x)
    for bad in (residual[:, :-1].contiguous(), residual.double(), residual.t().contiguous().t()):
        with pytest.raises(ValueError, match="residual"):
            biased(rows, bad)


def test_bad_rows_are_refused(build_dir):
    w = weights(64, 96, seed=3)
    bound = fm.bind(w, build_dir=build_dir)
    x = torch.randn(4, 96)
    assert torch.equal(bound(x), bound(x[None])[0])
    for bad, why in ((x.double(), "float32"), (x.to(torch.bfloat16), "float32"), (torch.randn(96, 4).t(), "contiguous"),
                     (torch.randn(4, 192)[:, ::2], "contiguous"), (torch.randn(17, 96), "1 to 16 rows"),
                     (torch.randn(0, 96), "1 to 16 rows"), (torch.randn(4, 80), "96 inputs"),
                     (torch.randn(2, 9, 96), "1 to 16 rows")):
        with pytest.raises(ValueError, match=why):
            bound(bad)


def test_a_replaced_weight_is_not_read(build_dir):
    """The product keeps the layer's tensors, not their storage: after `layer.weight.data = other`
    (or the bias's) a call is refused, and a product bound again reads the new weight."""
    layer = torch.nn.Linear(96, 40)
    bound = fm.bind(layer.weight, layer.bias, build_dir=build_dir)
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.allclose(bound(x), layer(x), rtol=1e-5, atol=1e-6)
        layer.weight.data = torch.randn(40, 96)
        with pytest.raises(ValueError, match="replaced"):
            bound(x)
        bound = fm.bind(layer.weight, layer.bias, build_dir=build_dir)
        assert torch.allclose(bound(x), layer(x), rtol=1e-5, atol=1e-6)
        layer.bias.data = torch.randn(40)
        with pytest.raises(ValueError, match="replaced"):
            bound(x)
        layer.weight.mul_(2)  # changed in place: the same storage, read as it is now
        bound = fm.bind(layer.weight, layer.bias, build_dir=build_dir)
        assert torch.allclose(bound(x), layer(x), rtol=1e-5, atol=1e-6)


def test_weights_it_does_not_take(build_dir):
    w = weights(32, 64, seed=4)
    bd = build_dir
    assert fm.bind(w, build_dir=bd) is not None
    assert fm.bind(weights(32, 72, seed=4), build_dir=bd) is None  # inputs not a multiple of 16
    assert fm.bind(w.double(), build_dir=bd) is None
    assert fm.bind(w.to(torch.bfloat16), build_dir=bd) is None
    assert fm.bind(w.t(), build_dir=bd) is None  # not contiguous
    assert fm.bind(w[0], build_dir=bd) is None  # not a matrix
    assert fm.bind(w, torch.zeros(31), build_dir=bd) is None  # a bias of another weight
    assert fm.bind(w, torch.zeros(32, dtype=torch.float64), build_dir=bd) is None
    assert fm.bind(w, torch.zeros(64)[::2], build_dir=bd) is None  # a bias not contiguous
    assert fm.bind(w, torch.zeros(32), build_dir=bd) is not None


def test_no_compiler_means_no_kernel_and_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_flags, "compiler", lambda: None)
    folder = tmp_path / "none"
    assert fm.bind(weights(32, 64, seed=5), build_dir=folder) is None
    assert "no C compiler" in fm.why_not()
    assert not folder.exists() or not any(folder.iterdir())
