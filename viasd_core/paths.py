"""Where viasd keeps its cache (converted models) and config (calibration profiles).

`VIASD_HOME` puts both under one folder (tests use a temporary one); otherwise the XDG
variables and their defaults are used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from viasd_core.errors import UsageError


def package_data() -> Path:
    """The data shipped inside the package (prompt sets, the embedded drafts)."""
    return Path(__file__).resolve().parent / "data"


def home() -> Path | None:
    value = os.environ.get("VIASD_HOME")
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    return _cache_dirs(os.environ.get("VIASD_HOME"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))[0]


def kernel_dir() -> Path:
    """Where viasd_kernels' C kernels are built for this machine (asked for at every kernel call of
    a pass: looked up once per environment)."""
    return _cache_dirs(os.environ.get("VIASD_HOME"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))[1]


@functools.lru_cache(maxsize=16)
def _cache_dirs(viasd_home: str | None, xdg: str | None, home_env: str | None) -> tuple[Path, Path]:
    """(cache folder, kernel folder) for these values of VIASD_HOME, XDG_CACHE_HOME and HOME."""
    base = home()
    cache = base / "cache" if base is not None else Path(xdg or str(Path.home() / ".cache")) / "viasd"
    return cache, cache / "kernels"


def config_dir() -> Path:
    base = home()
    if base is not None:
        return base / "config"
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(xdg) / "viasd"


def check_writable_dir(path: str | Path, what: str) -> Path:
    """Refuse (UsageError: one line, exit 2) a folder a command could not write its files in,
    before the command's work starts (its result must not be lost at the end). `path` is a folder,
    or does not exist yet and is created by the command when it writes: then its nearest existing
    ancestor must be a folder. Writable means a probe file can be created there (tempfile; then
    removed): permission bits alone do not stop root, /proc does. Nothing is created or left
    behind. `what` names the path in the message ("--out"). Returns the path, `~` expanded."""
    path = Path(path).expanduser()
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{what} '{path}' is a file: give a folder")
    _check_folder(path, what, path)
    return path


def check_writable_file(path: str | Path, what: str, noun: str = "file") -> Path:
    """Refuse (as check_writable_dir) a file atomic_write_text could not write: a folder, or one
    whose folder is not writable (or cannot be created)."""
    path = Path(path).expanduser()
    if os.path.isdir(path):
        raise UsageError(f"{what} '{path}' is a folder: give the path of the {noun} to write")
    _check_folder(path.parent, what, path)
    return path


def check_replaceable_dir(path: str | Path, what: str) -> Path:
    """Refuse (as check_writable_dir) a folder atomic_folder could not put in place: an existing
    file, or one whose parent folder is not writable (the new folder is made beside it)."""
    path = Path(path).expanduser()
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{what} '{path}' is a file: give a folder (an existing folder is replaced)")
    _check_folder(path.parent, what, path)
    return path


def _check_folder(folder: Path, what: str, shown: Path) -> None:
    """`folder` exists and takes a probe file, or its nearest existing ancestor does."""
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not os.path.isdir(folder):
        raise UsageError(f"{what} '{shown}': cannot write under '{folder}' (a file, not a folder): choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".viasd-probe-")
    except OSError as e:
        raise UsageError(f"{what} '{shown}': cannot write under '{folder}' ({e.strerror or e}): choose another path")
    os.close(fd)
    os.unlink(probe)


def write_elsewhere(write, name: str) -> Path | None:
    """Where a command's result goes when its own path fails at the end (the disk filled, the
    folder vanished): `write(folder)` into a new folder `unsaved/<name>-<UTC time>-XXXX` of the
    cache, else `viasd-unsaved-<name>-<UTC time>-XXXX` in the current folder. Returns that folder,
    or None when neither could be written (no half-written folder is left then)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for base, prefix in ((lambda: cache_dir() / "unsaved", f"{name}-{stamp}-"),
                         (Path.cwd, f"viasd-unsaved-{name}-{stamp}-")):
        try:
            base = base()  # the current folder may have vanished too
            base.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        except OSError:
            continue
        try:
            folder.chmod(0o755)  # mkdtemp makes it private
            write(folder)
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        return folder
    return None


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_folder(folder: Path):
    """Yield a temporary folder beside `folder` to fill; when the block ends normally it takes
    `folder`'s place by renames (an older one moved aside, then removed); on any error it is
    removed and `folder` is left as it was."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    old = folder.with_name(f".{folder.name}.old")
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
