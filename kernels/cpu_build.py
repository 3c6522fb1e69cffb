"""The C kernels of viasd_kernels, built on the user's machine with its own C compiler, once.

A kernel's C file ships with the package. The first call on a machine compiles it for that CPU
(`-O3 -march=native`, OpenMP; about a second) into a shared library under the folder the caller
names, keyed by the source and the headers beside it, the flags, the compiler and the CPU, written
under a temporary name and renamed; later calls load the library. torch.compile's CPU backend
compiles its C++ the same way. Where there is no compiler or the build fails, `build` returns None with the reason
(`why_not`), and the caller keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
BUILD_SECONDS = 120

_lock = threading.Lock()
_built: dict[tuple[Path, Path], ctypes.CDLL | None] = {}
_why_not: dict[Path, str] = {}


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


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(source: Path, build_dir: Path) -> ctypes.CDLL | None:
    """The library built from `source` for this machine (built now if it is not cached in
    `build_dir`), or None where it cannot be built here (`why_not(source)` says why)."""
    source, build_dir = Path(source), Path(build_dir)
    with _lock:
        key = (source, build_dir)
        if key not in _built:
            _built[key] = _build(source, build_dir)
        return _built[key]


_functions: dict[tuple[Path, Path, str], object] = {}


def function(source: Path, build_dir: Path, name: str, argtypes: list, restype=ctypes.c_int):
    """C function `name` of the library built from `source` (see `build`), with its argument and
    result types set, or None where the library cannot be built here."""
    # Asked for at every call of some kernels (row attention): Path() of a Path costs ~2 us
    key = (source if isinstance(source, Path) else Path(source),
           build_dir if isinstance(build_dir, Path) else Path(build_dir), name)
    if key not in _functions:
        lib = build(source, build_dir)
        fn = None
        if lib is not None:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        _functions[key] = fn
    return _functions[key]


def why_not(source: Path) -> str | None:
    """Why `source` could not be built or loaded here (None: it was, or was not tried)."""
    return _why_not.get(Path(source))


def _build(source: Path, build_dir: Path) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        _why_not[source] = "no C compiler found (set CC, or install gcc or clang)"
        return None
    digest = hashlib.sha256()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the C files include
    for part in (source.read_bytes(), headers, " ".join(FLAGS).encode(), _version(cc).encode(),
                 cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    lib = build_dir / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=build_dir, prefix=f".{lib.name}.", suffix=".tmp")
            os.close(fd)
        except OSError as e:
            _why_not[source] = f"cannot write the build folder {build_dir}: {e}"
            return None
        try:
            done = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=BUILD_SECONDS)
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["no message"])[0]
                _why_not[source] = f"{Path(cc).name} could not build {source.name}: {first}"
                return None
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError) as e:
            _why_not[source] = f"could not run {cc} on {source.name}: {e}"
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        _why_not[source] = f"could not load {lib.name}: {e}"
        return None
