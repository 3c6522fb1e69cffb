"""viasd_kernels.cpu_row_attention: the C kernel against its float64 reference, and the property it
exists for: a row's numbers are bit for bit the same whatever else its call holds."""

from __future__ import annotations

import os

import pytest
import torch
from support.avx2_class import built_or_skip, enter_avx2
from viasd_kernels import cpu_build, cpu_flags, cpu_row_attention as ra

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels")
    q = torch.zeros(1, 1, 1, 16)
    if ra.row_attention(q, q, q, 1, build_dir=path) is None:
        assert not os.environ.get("CI"), f"the row-attention kernel must build in CI: {ra.why_not()}"
        pytest.skip(f"the row-attention kernel cannot be built here: {ra.why_not()}")
    return path


def qkv(Hq, Hkv, T, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, Hq, T, D, generator=g).to(dtype), torch.randn(1, Hkv, S, D, generator=g).to(dtype),
            torch.randn(1, Hkv, S, D, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 16), (4, 2, 32), (9, 3, 64), (8, 1, 128), (12, 4, 48),  # generic widths
                                   # the compiled-in shapes: 1-4 heads of 64 a task (7 = 4 + 3), 1-2 of 128
                                   (5, 5, 64), (8, 4, 64), (16, 4, 64), (14, 2, 64), (6, 2, 128)],
                         ids=lambda s: "Hq{}kv{}D{}".format(*s))
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_equals_the_reference(build_dir, dtype, shape, window):
    Hq, Hkv, D = shape
    q, k, v = qkv(Hq, Hkv, 7, 60, D, dtype, seed=D + Hq)
    for end, scale in ((7, None), (37, 0.21), (60, None)):
        got = ra.row_attention(q, k, v, end, window, scale, build_dir=build_dir)
        assert got.shape == (1, 7, Hq * D) and got.dtype == dtype
        torch.testing.assert_close(got.double(), ra.row_attention_reference(q, k, v, end, window, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_alone_and_in_any_pass(build_dir, dtype):
    """Row i of a 16-row pass equals row i computed in passes of 1, 2 and 6 rows (bit for bit), at
    short and long contexts, with and without a window: sd == ar by construction."""
    q, k, v = qkv(9, 3, 16, 700, 64, dtype, seed=1)
    for end, window in ((16, None), (300, None), (690, None), (300, 40)):
        full = ra.row_attention(q, k, v, end, window, build_dir=build_dir)
        for T in (1, 2, 6):
            for lo in range(0, 16 - T + 1, 5):
                part = ra.row_attention(q[:, :, lo : lo + T], k, v, end - 16 + lo + T, window, build_dir=build_dir)
                assert torch.equal(part[0], full[0, lo : lo + T]), (end, window, T, lo)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_row_is_the_plain_row_over_its_path(build_dir, dtype):
    """A masked row (a token tree's node: the committed keys, its ancestors, itself, at scattered
    slots) equals the causal row over the same keys laid out contiguously, as after the path is kept."""
    q, k, v = qkv(4, 2, 3, 64, 32, dtype, seed=2)
    n, end = 40, 50
    rows = [[45], [41, 44], [42, 43, 47]]  # each row's tree slots past the committed n, its own last
    mask = torch.zeros(3, end, dtype=torch.bool)
    for t, slots in enumerate(rows):
        mask[t, :n] = True
        mask[t, slots] = True
    got = ra.row_attention(q, k, v, end, None, None, mask, build_dir=build_dir)
    for t, slots in enumerate(rows):
        keys = list(range(n)) + slots
        k2 = torch.zeros_like(k)
        v2 = torch.zeros_like(v)
        k2[:, :, : len(keys)], v2[:, :, : len(keys)] = k[:, :, keys], v[:, :, keys]
        plain = ra.row_attention(q[:, :, t : t + 1], k2, v2, len(keys), build_dir=build_dir)
        assert torch.equal(got[0, t], plain[0, 0])
    torch.testing.assert_close(got.double(), ra.row_attention_reference(q, k, v, end, None, None, mask), **TOL[dtype])


@pytest.fixture(scope="module")
def avx2_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels-avx2")


@pytest.fixture
def avx2_build(avx2_folder, monkeypatch):
    """A build folder whose kernel is built for the AVX2 class (the cap where this CPU is above it)."""
    enter_avx2(monkeypatch)
    lanes = ra.lanes(avx2_folder)
    built_or_skip(lanes == 8, f"the AVX2 class's row attention (lanes {lanes})", ra.why_not())
    return avx2_folder


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 16), (4, 2, 32), (9, 3, 64), (8, 1, 128), (12, 4, 48), (5, 5, 64),
                                   (16, 4, 64), (14, 2, 64), (6, 2, 128), (16, 1, 64), (4, 1, 512)],
                         ids=lambda s: "Hq{}kv{}D{}".format(*s))
def test_the_avx2_class_computes_the_plain_code_bit_for_bit(avx2_build, dtype, shape):
    """The AVX2 class's layout (heads8: registers of 8 floats) against the plain code built beside it,
    bit for bit: key counts that are and are not multiples of 8 and 16, windows, tree masks, 1-16 rows,
    1 and 2 threads."""
    Hq, Hkv, D = shape
    q, k, v = qkv(Hq, Hkv, 16, 300, D, dtype, seed=D + Hq + 7)
    k[:, :, 5] *= 40  # one key far above the rest: scores far from the max underflow in exp
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for T, end, window in ((1, 1, None), (1, 7, None), (1, 8, None), (1, 9, None), (3, 17, None),
                                   (6, 300, None), (16, 129, None), (2, 200, 37)):
                got = ra.row_attention(q[:, :, :T], k, v, end, window, build_dir=avx2_build)
                want = ra.row_attention(q[:, :, :T], k, v, end, window, build_dir=avx2_build, plain=True)
                assert torch.equal(got, want), (T, end, window, n_threads)
            mask = torch.rand(4, 120, generator=torch.Generator().manual_seed(D)) < 0.6
            mask[:, 0] = True
            got = ra.row_attention(q[:, :, :4], k, v, 120, None, None, mask, build_dir=avx2_build)
            assert torch.equal(got, ra.row_attention(q[:, :, :4], k, v, 120, None, None, mask, build_dir=avx2_build,
                                                     plain=True))
    finally:
        torch.set_num_threads(threads)


def test_stale_keys_past_the_pass_change_nothing(build_dir):
    q, k, v = qkv(4, 2, 4, 30, 16, torch.bfloat16, seed=3)
    got = ra.row_attention(q, k, v, 20, build_dir=build_dir)
    k[:, :, 20:], v[:, :, 20:] = 1e4, float("nan")
    assert torch.equal(ra.row_attention(q, k, v, 20, build_dir=build_dir), got)


def test_what_it_does_not_take_falls_back_or_is_refused(build_dir):
    q, k, v = qkv(4, 2, 3, 20, 24, torch.float32, seed=4)
    assert ra.row_attention(q, k, v, 10, build_dir=build_dir) is None  # D not a multiple of 16
    q, k, v = qkv(4, 2, 3, 20, 16, torch.float32, seed=4)
    assert ra.row_attention(q.half(), k.half(), v.half(), 10, build_dir=build_dir) is None
    assert ra.row_attention(q, k.bfloat16(), v.bfloat16(), 10, build_dir=build_dir) is None
    assert ra.row_attention(q, k[:, :, ::2], v[:, :, ::2], 8, build_dir=build_dir) is None  # not contiguous
    with pytest.raises(ValueError, match="refused"):
        ra.row_attention(q, k, v, 21, build_dir=build_dir)  # past the cache
    with pytest.raises(ValueError, match="refused"):
        ra.row_attention(q, k, v, 2, build_dir=build_dir)  # fewer slots than rows


def test_no_compiler_means_no_kernel_and_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_flags, "compiler", lambda: None)
    q, k, v = qkv(2, 1, 2, 8, 16, torch.float32, seed=5)
    assert ra.row_attention(q, k, v, 8, build_dir=tmp_path / "none") is None
    assert "no C compiler" in ra.why_not()


def test_a_folder_it_cannot_write_means_no_kernel_and_a_reason(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    q, k, v = qkv(2, 1, 2, 8, 16, torch.float32, seed=6)
    assert ra.row_attention(q, k, v, 8, build_dir=blocked / "kernels") is None
    assert "cannot write the build folder" in ra.why_not()


def test_a_failed_build_leaves_no_file_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_flags, "FLAGS", cpu_flags.FLAGS + ("-DVIASD_NOT_A_FLAG", "--not-a-flag"))
    if cpu_flags.compiler() is None:
        assert not os.environ.get("CI"), "CI needs a C compiler for the CPU kernels"
        pytest.skip("no C compiler here")
    assert cpu_build.build(ra.SOURCE, tmp_path / "bad") is None
    assert "could not build" in cpu_build.why_not(ra.SOURCE)
    assert list((tmp_path / "bad").iterdir()) == []


def test_the_library_is_built_once_and_named_for_this_machine(build_dir):
    libs = [p.name for p in build_dir.iterdir()]
    assert len(libs) == 1 and libs[0].startswith("cpu_row_attention-") and libs[0].endswith(".so")


def test_a_header_beside_the_source_is_part_of_the_library_name(tmp_path):
    """A C file's headers (cpu_bf16.h) change what it compiles to, so they key the build too."""
    if cpu_flags.compiler() is None:
        assert not os.environ.get("CI"), "CI needs a C compiler for the CPU kernels"
        pytest.skip("no C compiler here")
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe.c").write_text('#include "probe.h"\nint viasd_probe(void) { return PROBE; }\n')
    (src / "viasd_kernels.h").write_text("int viasd_probe(void);\n")
    (src / "probe.h").write_text("#define PROBE 1\n")
    first = cpu_build.function(src / "probe.c", tmp_path / "one", "viasd_probe")
    (src / "probe.h").write_text("#define PROBE 2\n")
    second = cpu_build.function(src / "probe.c", tmp_path / "two", "viasd_probe")
    assert (first(), second()) == (1, 2)
    assert {p.name for p in (tmp_path / "one").iterdir()} != {p.name for p in (tmp_path / "two").iterdir()}
