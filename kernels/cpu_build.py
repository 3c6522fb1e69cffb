"""The C kernels of viasd_kernels, built on the user's machine with its own C compiler, once.

A kernel's C file ships with the package. The first call on a machine compiles it for that CPU
(`-O3 -march=native`, OpenMP; about a second) into a shared library under the folder the caller
names, keyed by the source and the headers beside it, the flags, the compiler and the CPU, written
under a temporary name and renamed; later calls load the library. torch.compile's CPU backend
compiles its C++ the same way. Where there is no compiler or the build fails, `build` returns None with the reason
(`why_not`), and the caller keeps its PyTorch path.

- **One interface**: viasd_kernels.h holds the prototype of every exported function; every C file
  includes it, and the build makes a global function without a prototype there, an implicit
  declaration or a mismatched pointer an error. `function(source, build_dir, name)` sets the ctypes
  argument and result types from that header (`prototypes`: a small parser of the few types the
  interface uses), so a signature is written once.
- **Cache rules**: the build folder is made 0700; a folder or cached library owned by another user,
  or writable by its group or others, is refused (another user could put code there that this
  process would run), with the reason in `why_not`. A cached library that does not load (truncated,
  corrupt) is built again, once.
- **Portability**: `-march=native` where the compiler takes it, else `-mcpu=native` (aarch64), else
  no arch flag; OpenMP where a one-time probe compiles and links it (Apple's clang has none; nor has
  Debian's clang without libomp-dev), else the kernels run on one thread with the reason in
  `build_notes`. `OPENMP = False` turns it off (tests compare the two builds bit for bit).
- **Instruction-set cap**: VIASD_MAX_CPU_ISA (avx2, avx512, avx512_bf16, native; like oneDNN's
  ONEDNN_MAX_CPU_ISA) builds with -march=native less every extension above the cap; the cap is part
  of the library's key. `isa_class()` is the class in force, `describe_isa()` says it in a line.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

HEADER = "viasd_kernels.h"
# Warnings that are always errors: a signature that disagrees with the header cannot build. The rest
# of -Wall stays a warning on users' machines (a newer compiler's new warning must not cost them the
# kernels); tests/test_kernels_build.py builds every kernel with -Wall -Werror under gcc and clang.
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-Werror=missing-prototypes",
         "-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types", "-Werror=int-conversion",
         "-Werror=return-type")
BUILD_SECONDS = 120
OPENMP: bool | None = None  # None: where the compiler takes it; False: never (the same arithmetic, one thread)

ISA_ENV = "VIASD_MAX_CPU_ISA"
ISA_CLASSES = ("none", "avx2", "avx512", "avx512_bf16")  # x86-64's, lowest first; 'neon' on aarch64
CAPS = ("avx2", "avx512", "avx512_bf16", "native")
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
_ISA_SAYS = {
    "none": "no AVX2 (plain x86-64 code)",
    "avx2": "AVX2 and FMA",
    "avx512": "AVX-512 F/BW/VL/DQ and VNNI, no BF16",
    "avx512_bf16": "AVX-512 F/BW/VL/DQ, VNNI and BF16",
    "neon": "ARM NEON",
}

_lock = threading.Lock()
_built: dict[tuple, ctypes.CDLL | None] = {}
_why_not: dict[Path, str] = {}
_notes: dict[Path, str] = {}
_probed: dict[tuple, tuple[tuple[str, ...], str]] = {}


def compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and instruction-set flags, where readable."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features") and line not in parts:
                    parts.append(line)
                if line.strip() == "":
                    break  # the first processor says it for all
    except OSError:
        parts.append(platform.processor())
    return "".join(parts)


def cpu_isa_class() -> str:
    """This CPU's own instruction-set class: from /proc/cpuinfo's flags on Linux x86-64, 'neon' on
    aarch64, 'none' where neither says more."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    flags: set[str] = set()
    for line in cpu_identity().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags
    if avx512 and "avx512_bf16" in flags:
        return "avx512_bf16"
    if avx512:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "none"


def max_isa() -> str:
    """The cap VIASD_MAX_CPU_ISA sets ('native': none); ValueError for a value it does not know."""
    cap = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if cap not in CAPS:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not one of {', '.join(CAPS)}")
    return cap


def isa_class() -> str:
    """The instruction-set class the kernels are built for: the lower of the CPU's own and the cap
    (a cap names x86-64 classes: on other CPUs it changes nothing)."""
    own, cap = cpu_isa_class(), max_isa()
    if cap == "native" or own not in ISA_CLASSES:
        return own
    return min(own, cap, key=ISA_CLASSES.index)


def describe_isa() -> str:
    """One line for `viasd doctor`: the class in force, what it holds, and the cap if one applies."""
    own, cap, now = cpu_isa_class(), max_isa(), isa_class()
    line = f"{now}: {_ISA_SAYS[now]}"
    if now != own:
        return f"{line} (capped by {ISA_ENV}={cap}; this CPU: {own})"
    return line + (f" ({ISA_ENV}={cap} is no lower)" if cap != "native" and own in ISA_CLASSES else "")


def _version(cc: str) -> str:
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
    cap = max_isa()
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


# --- the header: ctypes types from the prototypes -------------------------------------------------

_VALUES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
_QUALIFIERS = {"const", "volatile", "restrict", "struct", "signed"}
_parsed: dict[Path, tuple[dict, dict]] = {}


def _ctype(decl: str, header: Path):
    """(name, ctypes type) of one declaration: any pointer an address (c_void_p), else a value type."""
    decl = " ".join(decl.split())
    m = re.fullmatch(r"(?P<type>.*?)(?P<name>\w*)", decl)
    typ, name = m["type"].strip(), m["name"]
    if "*" in typ:
        return name, ctypes.c_void_p
    words = [w for w in typ.split() if w not in _QUALIFIERS]
    if not words and name in _VALUES:  # an unnamed argument: `int`
        words, name = [name], ""
    if len(words) != 1 or words[0] not in _VALUES:
        raise ValueError(f"{header.name}: a type the Python side cannot take: {decl!r} (int, int64_t, float, "
                         f"double or a pointer)")
    return name, _VALUES[words[0]]


def _parse(header: Path) -> tuple[dict, dict]:
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", header.read_text(), flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    functions, structs = {}, {}
    for m in re.finditer(r"struct\s+(\w+)\s*\{([^}]*)\}\s*;", text):
        structs[m[1]] = [_ctype(field, header) for field in m[2].split(";") if field.strip()]
    text = re.sub(r"struct\s+(\w+)\s*\{[^}]*\}\s*;", " ", text)
    for statement in text.split(";"):
        statement = " ".join(statement.split())
        if not statement or re.fullmatch(r"struct \w+", statement):
            continue
        m = re.fullmatch(r"(?P<ret>[\w\s*]+?)\s*\b(?P<name>\w+)\s*\((?P<args>[^()]*)\)", statement)
        if m is None:
            raise ValueError(f"{header.name}: not a prototype the Python side can read: {statement!r}")
        ret = None if m["ret"].split() == ["void"] else _ctype(m["ret"] + " x", header)[1]
        args = [] if m["args"].strip() in ("", "void") else [_ctype(a, header)[1] for a in m["args"].split(",")]
        functions[m["name"]] = (ret, args)
    return functions, structs


def _header(header: Path) -> tuple[dict, dict]:
    if header not in _parsed:
        _parsed[header] = _parse(header)
    return _parsed[header]


def prototypes(header: Path | None = None) -> dict[str, tuple[object, list]]:
    """name -> (restype, argtypes) of every function viasd_kernels.h (or `header`) declares."""
    return _header(Path(header) if header else Path(__file__).with_name(HEADER))[0]


def struct_fields(name: str, header: Path | None = None) -> list[tuple[str, object]]:
    """ctypes `_fields_` of `struct name` as viasd_kernels.h (or `header`) defines it."""
    return _header(Path(header) if header else Path(__file__).with_name(HEADER))[1][name]


# --- building and loading -------------------------------------------------------------------------

def build(source: Path, build_dir: Path) -> ctypes.CDLL | None:
    """The library built from `source` for this machine (built now if it is not cached in
    `build_dir`), or None where it cannot be built here (`why_not(source)` says why)."""
    source, build_dir = Path(source), Path(build_dir)
    with _lock:
        key = (source, build_dir, os.environ.get(ISA_ENV), OPENMP, FLAGS)
        if key not in _built:
            _built[key] = _build(source, build_dir)
        return _built[key]


_functions: dict[tuple, object] = {}


def function(source: Path, build_dir: Path, name: str, argtypes: list | None = None):
    """C function `name` of the library built from `source` (see `build`), its argument and result
    types those of its prototype in the header beside `source`, or None where the library cannot
    be built here or has no such function (`why_not`). `argtypes`, where a caller still passes its
    own, must be the header's (ValueError otherwise)."""
    # Asked for at every call of some kernels (row attention): Path() of a Path costs ~2 us, reading
    # the environment ~0.4 us, so the cap and OPENMP in force when a folder's function is first
    # asked for stay its own for the process (as oneDNN reads ONEDNN_MAX_CPU_ISA once); another
    # folder gets the cap in force then
    key = (source, build_dir, name)
    fn = _functions.get(key, False)
    if fn is False:
        source = source if isinstance(source, Path) else Path(source)
        build_dir = build_dir if isinstance(build_dir, Path) else Path(build_dir)
        fn = None
        try:
            proto = _header(source.with_name(HEADER))[0].get(name)
            if proto is None:
                _why_not[source] = f"{HEADER} has no prototype for {name}"
        except OSError as e:
            proto, _why_not[source] = None, f"cannot read the {HEADER} beside {source.name}: {e}"
        if proto is not None and argtypes is not None and list(argtypes) != proto[1]:
            raise ValueError(f"{name}: argtypes {argtypes} disagree with {HEADER}'s prototype: {proto[1]}")
        if proto is not None and (lib := build(source, build_dir)) is not None:
            try:
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = proto
            except AttributeError:
                fn = None
                _why_not[source] = f"the library built from {source.name} has no function {name}"
        _functions[key] = fn
    return fn


def why_not(source: Path) -> str | None:
    """Why `source` could not be built or loaded here (None: it was, or was not tried)."""
    return _why_not.get(Path(source))


def build_notes(source: Path) -> str | None:
    """What the build of `source` left out here and why (no OpenMP, no arch flag), or None."""
    return _notes.get(Path(source)) or None


def _unsafe(path: Path, what: str) -> str | None:
    """Why this process must not trust `path` (a folder it builds in, a library it loads): another
    user's, or one its group or others may write. None where it is safe."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        return f"the {what} {path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"the {what} {path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _compile(cc: str, flags: tuple, source: Path, lib: Path) -> str | None:
    """Builds `lib` from `source` under a temporary name, then renames it; the reason it could not."""
    try:
        fd, tmp = tempfile.mkstemp(dir=lib.parent, prefix=f".{lib.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        return f"cannot write the build folder {lib.parent}: {e}"
    try:
        header = source.with_name(HEADER)
        include = ["-include", str(header)] if header.exists() else []  # checked even where a file forgets it
        done = subprocess.run([cc, *flags, *include, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=BUILD_SECONDS, env={**os.environ, "LC_ALL": "C"})
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            return f"{Path(cc).name} could not build {source.name}: {first}"
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not run {cc} on {source.name}: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return None


def _build(source: Path, build_dir: Path) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        _why_not[source] = "no C compiler found (set CC, or install gcc or clang)"
        return None
    flags, notes = build_flags(cc)
    _notes[source] = notes
    digest = hashlib.sha256()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the C files include
    for part in (source.read_bytes(), headers, " ".join(flags).encode(), max_isa().encode(),
                 _version(cc).encode(), cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    lib = build_dir / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    try:
        build_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        why = _unsafe(build_dir, "build folder")
    except OSError as e:
        why = f"cannot write the build folder {build_dir}: {e}"
    if why is None and lib.exists():
        why = _unsafe(lib, "cached library")
        if why is None:
            try:
                return ctypes.CDLL(str(lib))
            except OSError:
                pass  # truncated or corrupt (a full disk, a killed copy): built again below, once
    if why is None:
        why = _compile(cc, flags, source, lib)
    if why is None:
        try:
            return ctypes.CDLL(str(lib))
        except OSError as e:
            why = f"could not load {lib.name}: {e}"
    _why_not[source] = why
    return None
