"""viasd_kernels.cpu_build: how the C kernels are built, cached and loaded.

The cache's rules (a folder or library another user owns or others may write is refused, a corrupt
library is built again), the portable builds (every kernel with -Wall -Werror under gcc and clang,
without OpenMP bit for bit the same as with it) and the instruction-set cap VIASD_MAX_CPU_ISA (the
packed products refuse a cap below AVX-512 BF16, saying so; the other kernels give the same bits under
a cap as without).

A C compiler is required under CI; elsewhere these tests skip without one. The clang build runs
where clang is on the PATH (scripts/test.sh installs it where it can).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from support.int4_cases import case, pack
from viasd_kernels import (cpu_build, cpu_flags, cpu_header, cpu_int4_widen as cw, cpu_packed_mm as pm, cpu_rms_norm as rn,
                           cpu_rope_write as rw, cpu_row_attention as ra, instruction_set)

SOURCES = sorted(Path(cpu_build.__file__).parent.glob("cpu_*.c"))


@pytest.fixture(autouse=True)
def _needs_a_compiler():
    if cpu_flags.compiler() is None:
        assert not os.environ.get("CI"), "CI needs a C compiler for the CPU kernels"
        pytest.skip("no C compiler here")


def outputs(build_dir, threads: int = 2) -> dict[str, torch.Tensor]:
    """Every kernel's results on fixed inputs (built into `build_dir` with the flags in force), at
    `threads` threads; the packed products where they run."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    out = {}
    for dt in (torch.float32, bf):
        w, x = torch.randn(96, generator=g).to(dt), torch.randn(5, 96, generator=g).to(dt)
        norm = rn.bind(w, 1e-6, build_dir=build_dir)
        assert norm is not None, rn.why_not()
        out[f"rms_norm {dt}"] = norm(x)
        kc, vc = torch.zeros(1, 2, 20, 32, dtype=dt), torch.zeros(1, 2, 20, 32, dtype=dt)
        writer = rw.bind(kc, vc, build_dir=build_dir)
        assert writer is not None, rw.why_not()
        q, k, v = (torch.randn(1, 3, h * 32, generator=g).to(dt) for h in (4, 2, 2))
        cos, sin = torch.randn(3, 32, generator=g).to(dt), torch.randn(3, 32, generator=g).to(dt)
        out[f"rope q {dt}"] = writer(q, k, v, cos, sin, torch.tensor([4, 9, 11]))
        out[f"rope cache {dt}"] = torch.cat([kc, vc])
        for D in (64, 48):
            q, k, v = (torch.randn(1, h, s, D, generator=g).to(dt) for h, s in ((8, 6), (2, 60), (2, 60)))
            out[f"attention {dt} D{D}"] = ra.row_attention(q, k, v, 40, None, None, build_dir=build_dir)
            out[f"attention {dt} D{D} window"] = ra.row_attention(q, k, v, 40, 7, 0.3, build_dir=build_dir)
    values, sz = case(128, 256, 32, seed=1)
    out["int4_widen"] = cw.widen(pack(values, 64), 32, sz, 64, build_dir=build_dir)
    if pm.available(build_dir):
        x = (torch.randn(6, 256, generator=g) * 4).to(bf)
        out["int4_mm"] = pm.bind_int4(pack(values, 64), 32, sz, 64, build_dir=build_dir)(x)
        q8 = torch.randint(-128, 128, (40, 256), generator=g, dtype=torch.int8)
        out["int8_mm"] = pm.bind_int8(q8, (torch.rand(40, generator=g) * 0.01).to(bf), build_dir=build_dir)(x)
    assert all(t is not None for t in out.values()), [k for k, t in out.items() if t is None]
    return out


def assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key].view(-1).view(torch.uint8),
                                                             b[key].view(-1).view(torch.uint8)), key


# --- the cache's rules ------------------------------------------------------------------------------

def test_the_build_folder_is_made_private(tmp_path):
    assert rn.bind(torch.ones(16), 1e-6, build_dir=tmp_path / "new" / "kernels") is not None
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "kernels").st_mode) & 0o077 == 0


def test_a_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    assert rn.bind(torch.ones(16), 1e-6, build_dir=folder) is None
    assert "writable by its group or others" in rn.why_not() and str(folder) in rn.why_not()
    assert list(folder.iterdir()) == []  # nothing built there


def test_a_folder_or_library_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:  # only root can hand a file to another user
        assert not os.environ.get("CI"), "CI runs as root: this test must run there"
        pytest.skip("not root: cannot make a file another user's")
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 12345, 12345)
    assert rn.bind(torch.ones(16), 1e-6, build_dir=folder) is None
    assert "belongs to another user (uid 12345)" in rn.why_not()

    ours = tmp_path / "ours"
    assert rn.bind(torch.ones(16), 1e-6, build_dir=ours) is not None
    (lib,) = ours.iterdir()
    copy = tmp_path / "copy"
    copy.mkdir(mode=0o700)
    shutil.copy(lib, copy / lib.name)
    os.chown(copy / lib.name, 12345, 12345)  # a library someone else left in our folder
    assert rn.bind(torch.ones(16), 1e-6, build_dir=copy) is None
    assert "cached library" in rn.why_not() and "another user" in rn.why_not()
    loose = tmp_path / "loose"  # (a process decides once a folder: another one)
    loose.mkdir(mode=0o700)
    shutil.copy(lib, loose / lib.name)
    os.chmod(loose / lib.name, 0o766)  # ours, but others may write it
    assert cpu_build.build(rn.SOURCE, loose) is None
    assert "writable by its group or others" in rn.why_not()


def test_a_corrupt_library_is_built_again(tmp_path):
    x, w = torch.randn(3, 32), torch.randn(32)
    want = rn.bind(w, 1e-6, build_dir=tmp_path / "good")(x)
    (lib,) = (tmp_path / "good").iterdir()
    broken = tmp_path / "broken"
    broken.mkdir(mode=0o700)
    (broken / lib.name).write_bytes(lib.read_bytes()[:300])  # truncated: a killed copy, a full disk
    norm = rn.bind(w, 1e-6, build_dir=broken)
    assert norm is not None, rn.why_not()
    assert torch.equal(norm(x), want)
    assert [p.name for p in broken.iterdir()] == [lib.name] and (broken / lib.name).stat().st_size > 300


# --- portable builds ---------------------------------------------------------------------------------

def strict_build(cc: str, source, out) -> subprocess.CompletedProcess:
    flags, _ = cpu_flags.build_flags(cc)
    return subprocess.run([cc, *flags, "-Werror", "-include", str(source.with_name(cpu_header.HEADER)), str(source),
                           "-o", str(out), "-lm"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})


def clang_or_skip() -> str:
    clang = shutil.which("clang")
    if clang is None:  # scripts/test.sh installs it where apt-get can (not offline)
        pytest.skip("clang is not on the PATH")
    return clang


@pytest.mark.parametrize("clang", [False, True], ids=["cc", "clang"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_kernel_builds_without_a_warning(tmp_path, source, clang):
    """-Wall -Werror with the machine's compiler and with clang: clang has no __builtin_shuffle and
    ignores GCC's optimize attribute (cpu_row_attention.c, cpu_bf16.h), and warns where GCC does not."""
    done = strict_build(clang_or_skip() if clang else cpu_flags.compiler(), source, tmp_path / "lib.so")
    assert done.returncode == 0, done.stderr


def test_clang_builds_compute_what_they_should(tmp_path, monkeypatch):
    """Debian's clang has no OpenMP without libomp-dev (built without it: one thread). Its results may
    differ from GCC's where the C leaves the compiler a choice (contracting a * b + c), so each kernel
    is checked on its own terms: bit for bit PyTorch's operators where it is defined so, close to
    GCC's build otherwise, and a row's bits the same alone and in a pass."""
    clang = clang_or_skip()
    by_cc = outputs(tmp_path / "cc")
    monkeypatch.setenv("CC", clang)
    by_clang = outputs(tmp_path / "clang")
    assert "no OpenMP" in (cpu_build.build_notes(rn.SOURCE) or "") or "-fopenmp" in cpu_flags.build_flags(clang)[0]
    assert by_clang.keys() == by_cc.keys()
    exact = [k for k in by_cc if k.startswith(("rope", "int4_widen"))]  # PyTorch's roundings, step by step
    for key in by_cc:
        if key in exact:
            assert torch.equal(by_clang[key], by_cc[key]), key
        else:
            torch.testing.assert_close(by_clang[key].float(), by_cc[key].float(), rtol=1e-2, atol=1e-2, msg=key)
    q, k, v = (torch.randn(1, h, s, 64).to(torch.bfloat16) for h, s in ((8, 16), (2, 90), (2, 90)))
    full = ra.row_attention(q, k, v, 80, build_dir=tmp_path / "clang")
    for t in range(16):
        alone = ra.row_attention(q[:, :, t : t + 1], k, v, 80 - 15 + t, build_dir=tmp_path / "clang")
        assert torch.equal(alone[0, 0], full[0, t]), t


def test_without_openmp_every_kernel_gives_the_same_bits(tmp_path, monkeypatch):
    """OpenMP only splits work between threads (outputs, rows, heads; never a sum): a build without it
    (Apple's clang) computes the same numbers on one thread."""
    with_omp = outputs(tmp_path / "omp")
    assert "-fopenmp" in cpu_flags.build_flags(cpu_flags.compiler())[0], "this compiler takes OpenMP here"
    monkeypatch.setattr(cpu_flags, "OPENMP", False)
    assert "-fopenmp" not in cpu_flags.build_flags(cpu_flags.compiler())[0]
    without = outputs(tmp_path / "no-omp")
    assert "no OpenMP" in cpu_build.build_notes(rn.SOURCE)
    assert_same_bits(with_omp, without)


def test_a_compiler_without_openmp_builds_without_it_and_says_so(tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp (Apple's clang) still builds every kernel."""
    real = cpu_flags._compiles

    def no_openmp(cc, flags, openmp):
        return (False, "clang: error: unsupported option '-fopenmp'") if "-fopenmp" in flags else real(cc, flags, openmp)

    monkeypatch.setattr(cpu_flags, "_compiles", no_openmp)
    monkeypatch.setattr(cpu_flags, "_probed", {})
    flags, notes = cpu_flags.build_flags(cpu_flags.compiler())
    assert "-fopenmp" not in flags and "-march=native" in flags and "unsupported option '-fopenmp'" in notes
    assert rn.bind(torch.ones(16), 1e-6, build_dir=tmp_path) is not None


# --- the instruction-set cap -------------------------------------------------------------------------

def test_an_unknown_cap_is_refused_naming_the_valid_ones(monkeypatch):
    monkeypatch.setenv(instruction_set.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="avx1024.*avx2, avx512, avx512_bf16, native"):
        instruction_set.isa_class()


def test_the_class_in_force_is_the_lower_of_the_cpus_and_the_cap(monkeypatch):
    own = instruction_set.cpu_isa_class()
    monkeypatch.delenv(instruction_set.ISA_ENV, raising=False)
    assert instruction_set.isa_class() == own and instruction_set.describe_isa().startswith(own)
    if own not in instruction_set.ISA_CLASSES:  # aarch64: the caps name x86-64's classes
        monkeypatch.setenv(instruction_set.ISA_ENV, "avx2")
        assert instruction_set.isa_class() == own
        return
    for cap in ("avx2", "avx512", "avx512_bf16"):
        monkeypatch.setenv(instruction_set.ISA_ENV, cap.upper())  # any case
        lower = min(own, cap, key=instruction_set.ISA_CLASSES.index)
        assert instruction_set.isa_class() == lower
        assert ("capped by" in instruction_set.describe_isa()) == (lower != own), instruction_set.describe_isa()


def cap_or_skip(cap: str) -> None:
    own = instruction_set.cpu_isa_class()
    if own not in instruction_set.ISA_CLASSES or instruction_set.ISA_CLASSES.index(own) <= instruction_set.ISA_CLASSES.index(cap):
        pytest.skip(f"this CPU's class ({own}) is not above {cap}: the cap changes nothing here")


@pytest.mark.parametrize("cap", ["avx2", "avx512"])
def test_a_cap_below_bf16_takes_the_portable_packed_products_and_changes_no_other_bits(tmp_path, monkeypatch, cap):
    """Under the cap the kernels are built without the instructions above it (the library's key
    changes with it); the packed products' AVX-512 BF16 way says the cap is why it does not run, and
    their portable way runs instead. The others' arithmetic is fixed by their C (vectors of 16
    lanes, the same FMA contractions wherever the class has FMA), so their bits do not change."""
    cap_or_skip(cap)
    monkeypatch.delenv(instruction_set.ISA_ENV, raising=False)
    native = outputs(tmp_path / "native")
    monkeypatch.setenv(instruction_set.ISA_ENV, cap)
    assert instruction_set.isa_class() == cap
    assert pm.available(tmp_path / "capped") and pm.way(tmp_path / "capped") == pm.PORTABLE_WAY
    assert pm.why_not(tmp_path / "capped") == f"{instruction_set.ISA_ENV}={cap} caps the instruction set below AVX-512 BF16"
    flags = cpu_flags.build_flags(cpu_flags.compiler())[0]
    assert ("-mno-avx512f" in flags) == (cap == "avx2") and ("-mno-avx512bf16" in flags) == (cap == "avx512")
    capped = outputs(tmp_path / "capped")
    assert_same_bits({k: v for k, v in native.items() if "_mm" not in k}, {k: v for k, v in capped.items() if "_mm" not in k})
    libs = {p.name for p in (tmp_path / "capped").iterdir()} & {p.name for p in (tmp_path / "native").iterdir()}
    assert not libs  # other flags, other libraries
    if cap == "avx2":  # really built without AVX-512: the int4 widening's AVX-512 path is compiled out
        lib = next((tmp_path / "capped").glob("cpu_int4_widen-*.so"))
        dump = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True)
        if dump.returncode == 0:
            assert "zmm" not in dump.stdout


def test_the_bf16_cap_keeps_the_packed_products(tmp_path, monkeypatch):
    own = instruction_set.cpu_isa_class()
    if own != "avx512_bf16":
        pytest.skip(f"this CPU's class is {own}: no AVX-512 BF16 to keep")
    monkeypatch.delenv(instruction_set.ISA_ENV, raising=False)
    native = outputs(tmp_path / "native")
    monkeypatch.setenv(instruction_set.ISA_ENV, "avx512_bf16")
    assert pm.available(tmp_path / "capped"), pm.why_not(tmp_path / "capped")
    assert_same_bits(native, outputs(tmp_path / "capped"))
