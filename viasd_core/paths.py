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
from pathlib import Path


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
