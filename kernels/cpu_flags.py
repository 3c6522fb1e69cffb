"""The flags the C kernels build with on this machine, and the compiler that takes them.

- **Portability**: `-march=native` where the compiler takes it, else `-mcpu=native` (aarch64), else
  no arch flag; OpenMP where a one-time probe compiles and links it (Apple's clang has none; nor has
  Debian's clang without libomp-dev), else the kernels run on one thread with the reason in
  cpu_build's `build_notes`. `OPENMP = False` turns it off (tests compare the two builds bit for bit).
- **Instruction-set cap** (instruction_set.py): -march=native less every extension above the cap; a flag
  this compiler does not know is dropped.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import instruction_set

# Warnings that are always errors: a signature that disagrees with the header cannot build. The rest
# of -Wall stays a warning on users' machines (a newer compiler's new warning must not cost them the
# kernels); tests/kernels/test_kernels_build.py builds every kernel with -Wall -Werror under gcc and clang.
# -Wno-psabi: on a CPU without AVX-512 (and under the avx2 cap) GCC and clang note that the 64-byte
# vectors cpu_bf16.h's static helpers take and return would pass otherwise than with AVX-512F; no
# exported function takes one, so no caller sees that ABI, and the note came first in every build
# error's message (seen on an AVX2-only EPYC, 2026-12-02).
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-Wno-psabi", "-Werror=missing-prototypes",
         "-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types", "-Werror=int-conversion",
         "-Werror=return-type")
BUILD_SECONDS = 120
OPENMP: bool | None = None  # None: where the compiler takes it; False: never (the same arithmetic, one thread)

_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mno-amx-fp16", "-mno-amx-complex")
# What -march=native keeps above each cap, turned off. -mno-avx512f turns off every AVX-512 subset.
# AVX-VNNI and its kin (256-bit VEX forms from Alder Lake / Sapphire Rapids on) are above avx2: the
# avx2 class is a Haswell's AVX2 + FMA. The avx512 class keeps whatever other AVX-512 subsets the CPU
# has (VBMI, IFMA, ...) and loses BF16, FP16 and AMX. Flags this compiler does not know are dropped
# (it cannot turn on what it does not know).
_ISA_OFF = {
    "avx2": ("-mno-avx512f", "-mno-avxvnni", "-mno-avxifma", "-mno-avxvnniint8", "-mno-avxvnniint16",
             "-mno-avxneconvert", *_AMX),
    "avx512": ("-mno-avx512bf16", "-mno-avx512fp16", *_AMX),
    "avx512_bf16": ("-mno-avx512fp16", *_AMX),
}

_probed: dict[tuple, tuple[tuple[str, ...], str]] = {}


def compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compiler_version(cc: str) -> str:
    """What `cc --version` says (part of the built library's key; '' where it cannot run)."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


_PROBE = "#include <omp.h>\nint viasd_probe(void);\nint viasd_probe(void) { return omp_get_max_threads(); }\n"
_UNKNOWN = re.compile(r"(?:unrecognized command[- ]line option|unknown argument:?)\s*'(-[^']+)'")


def _compiles(cc: str, flags: list[str], openmp: bool) -> tuple[bool, str]:
    """Whether `cc` builds and links a tiny library with `flags` (with OpenMP's header and runtime
    when `openmp`), and its first error line."""
    with tempfile.TemporaryDirectory(prefix="viasd-probe-") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(_PROBE if openmp else _PROBE.split("\n", 1)[1].replace("omp_get_max_threads()", "0"))
        try:
            done = subprocess.run([cc, *FLAGS, *flags, str(src), "-o", str(Path(tmp) / "probe.so")],
                                  capture_output=True, text=True, timeout=BUILD_SECONDS,
                                  env={**os.environ, "LC_ALL": "C"})
        except (OSError, subprocess.SubprocessError) as e:
            return False, str(e)
        return done.returncode == 0, "\n".join(done.stderr.strip().splitlines()[:20])


def build_flags(cc: str) -> tuple[tuple[str, ...], str]:
    """The flags `cc` builds the kernels with on this machine (FLAGS, then the arch, cap and OpenMP
    flags it takes: probed once a process, one tiny build where everything is taken), and a line
    saying what was left out and why ('' where nothing)."""
    cap = instruction_set.max_isa()
    key = (cc, cap, OPENMP, FLAGS)
    if key in _probed:
        return _probed[key]
    notes = []
    off = list(_ISA_OFF.get(cap, ())) if platform.machine().lower() in ("x86_64", "amd64") else []
    arch = ["-march=native", *off]
    want_omp = OPENMP is not False
    ok, err = _compiles(cc, arch + ["-fopenmp"] * want_omp, want_omp)
    if not ok:  # one by one: the arch flags, the cap's flags it knows, then OpenMP
        arch = []
        for first in (["-march=native"], ["-mcpu=native"]):
            if _compiles(cc, first, False)[0]:
                arch = first
                break
        if not arch:
            notes.append("no -march=native or -mcpu=native (generic code)")
        elif arch == ["-march=native"] and off:
            for _ in range(len(off)):
                ok, err = _compiles(cc, arch + off, False)
                unknown = set(_UNKNOWN.findall(err))
                if ok or not unknown & set(off):
                    break
                off = [f for f in off if f not in unknown]
            if not ok:
                notes.append(f"the cap's flags refused ({err.splitlines()[0] if err else 'no message'})")
                off = []
            arch = arch + off
        if want_omp:
            ok, err = _compiles(cc, arch + ["-fopenmp"], True)
            if not ok:
                want_omp = False
                notes.append(f"no OpenMP, one thread ({err.splitlines()[0] if err else 'no message'})")
    if OPENMP is False:
        notes.append("no OpenMP, one thread (turned off)")
    _probed[key] = ((*FLAGS, *arch, *(["-fopenmp"] if want_omp else [])), "; ".join(notes))
    return _probed[key]
