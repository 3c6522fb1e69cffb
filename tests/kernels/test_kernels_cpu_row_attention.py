"""viasd_kernels.cpu_row_attention: the C kernel against its float64 reference, and the property it
exists for: a row's numbers are bit for bit the same whatever else its call holds."""

from __future__ import annotations

import os

import pytest
import torch
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
