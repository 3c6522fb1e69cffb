"""The C kernels of viasd_kernels, built on the user's machine with its own C compiler, once.

A kernel's C file ships with the package. The first call on a machine compiles it for that CPU
(`-O3 -march=native`, OpenMP; about a second: the flags are cpu_flags.py's, the instruction-set cap
instruction_set.py's) into a shared library under the folder the caller names, keyed by the source and the
headers beside it, the flags, the compiler and the CPU, written under a temporary name and renamed;
later calls load the library. torch.compile's CPU backend compiles its C++ the same way. Where there
is no compiler or the build fails, `build` returns None with the reason (`why_not`), and the caller
keeps its PyTorch path. `function(source, build_dir, name)` is one C function of it, its ctypes
argument and result types those of its prototype in viasd_kernels.h (cpu_header.py).

- **Cache rules**: the build folder is made 0700; a folder or cached library owned by another user,
  or writable by its group or others, is refused (another user could put code there that this
  process would run), with the reason in `why_not`. A cached library that does not load (truncated,
  corrupt) is built again, once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from . import cpu_flags, cpu_header, instruction_set
from .cpu_header import HEADER

_lock = threading.Lock()
_built: dict[tuple, ctypes.CDLL | None] = {}
_why_not: dict[Path, str] = {}
_notes: dict[Path, str] = {}


def build(source: Path, build_dir: Path) -> ctypes.CDLL | None:
    """The library built from `source` for this machine (built now if it is not cached in
    `build_dir`), or None where it cannot be built here (`why_not(source)` says why)."""
    source, build_dir = Path(source), Path(build_dir)
    with _lock:
        key = (source, build_dir, os.environ.get(instruction_set.ISA_ENV), cpu_flags.OPENMP, cpu_flags.FLAGS)
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
            proto = cpu_header.read(source.with_name(HEADER))[0].get(name)
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
                              timeout=cpu_flags.BUILD_SECONDS, env={**os.environ, "LC_ALL": "C"})
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
    cc = cpu_flags.compiler()
    if cc is None:
        _why_not[source] = "no C compiler found (set CC, or install gcc or clang)"
        return None
    flags, notes = cpu_flags.build_flags(cc)
    _notes[source] = notes
    digest = hashlib.sha256()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the C files include
    for part in (source.read_bytes(), headers, " ".join(flags).encode(), instruction_set.max_isa().encode(),
                 cpu_flags.compiler_version(cc).encode(), instruction_set.cpu_identity().encode()):
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
