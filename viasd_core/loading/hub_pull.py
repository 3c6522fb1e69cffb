"""Pull a model from the Hugging Face Hub into the local cache: disk check, then download with progress.

`pull` fetches what `plan_pull` (hub_plan.py) found missing, after checking free disk space for
it, through huggingface_hub (which resumes an interrupted file): weights first, config.json
last, the branch ref at the very end, so hub.resolve_local never takes an interrupted pull for
a complete model. Progress is a Rich bar on stderr. `fetch` is what a model option does with a
hub id: the cached snapshot, else `pull` on first use. `pull_file` fetches one file the same way
(a GGUF file of a hub repo: gguf_refs.py).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from huggingface_hub import hf_hub_download

from viasd_core.errors import ViasdError
from viasd_core.loading.hub import (
    check_repo_id,
    hf_cache_dir,
    hf_offline,
    pull_hint,
    repo_folder,
    resolve_local,
    rev_text,
)
from viasd_core.loading.hub_plan import (
    RemoteFile,
    hub_errors,
    is_cached_file,
    no_network_error,
    partial_bytes,
    plan_pull,
    ref_points_to,
)

# Free space `pull` keeps on top of the bytes it fetches: 512 MiB plus 5 %.
DISK_MARGIN_BYTES = 512 * 2**20
DISK_MARGIN_FRACTION = 0.05


def check_disk_space(bytes_needed: int, folder: Path, what: str = "the download") -> None:
    """Raise when `folder`'s disk has less free space than `bytes_needed` plus the margin."""
    if bytes_needed <= 0:
        return
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    required = bytes_needed + DISK_MARGIN_BYTES + int(bytes_needed * DISK_MARGIN_FRACTION)
    if free < required:
        raise ViasdError(
            f"not enough disk space for {what}: it needs {format_bytes(bytes_needed)} "
            f"(+{format_bytes(required - bytes_needed)} margin) but only {format_bytes(free)} is free in {folder}; "
            "free some space or point HF_HUB_CACHE to a larger disk"
        )


def format_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class _ProgressAdapter:
    """Stands in for the tqdm bar huggingface_hub creates per file and feeds a Rich task.

    It mirrors huggingface_hub's own `_AggregatedTqdm` (snapshot_download): `update_transfer`
    makes Xet downloads report through this one bar. `progress=None` makes it silent.
    """

    progress = None  # rich.progress.Progress
    task = None

    def __init__(self, *args, **kwargs):
        self.total = kwargs.get("total")
        self.n = kwargs.get("initial", 0) or 0
        if self.progress is not None and self.n:
            self.progress.advance(self.task, self.n)

    def update(self, n=1):
        n = int(n or 0)
        self.n += n
        if self.progress is not None and n:
            self.progress.advance(self.task, n)

    def update_transfer(self, n=1):
        pass

    def set_postfix_str(self, *args, **kwargs):
        pass

    def set_transfer_postfix_str(self, *args, **kwargs):
        pass

    def set_description(self, *args, **kwargs):
        pass

    def set_description_str(self, *args, **kwargs):
        pass

    def refresh(self, *args, **kwargs):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def _download_bar(console, label: str, total: int):
    """A tqdm stand-in class for huggingface_hub, feeding one Rich bar of `total` bytes on `console`
    (silent when `console` is None); `bar.describe(text)` names the file being fetched."""
    bar = type("_Bar", (_ProgressAdapter,), {})
    bar.describe = classmethod(lambda cls, text: cls.progress.update(cls.task, description=text) if cls.progress else None)
    with contextlib.ExitStack() as stack:
        if console:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            rich_progress = stack.enter_context(
                Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    DownloadColumn(),
                    TransferSpeedColumn(),
                    TimeRemainingColumn(),
                    console=console,
                    transient=False,
                )
            )
            bar.progress = rich_progress
            bar.task = rich_progress.add_task(label, total=total)
        yield bar


def pull(repo_id: str, revision: str | None = None, progress: bool = True, head: bool = False) -> Path:
    """Download what generation needs of `repo_id` at `revision` into the HF cache; return its snapshot.

    Fetches the safetensors weights (and index), config.json, generation_config.json and the
    tokenizer files; nothing else (no .bin, no `original/` folder). Before downloading, checks
    free disk space for the bytes not already cached (with a margin).

    Idempotent: when every file is cached and the ref is current, nothing is downloaded (one
    listing call to the Hub). Offline (HF_HUB_OFFLINE=1), a complete cached copy is returned
    and anything else is an error.

    Interruptions: huggingface_hub downloads each file into `blobs/<hash>.incomplete` and renames
    it when complete, and resumes an `.incomplete` blob on the next call; viasd relies on that
    and writes no files of its own. Files are fetched weights first and config.json last, and
    the branch ref is written at the very end, so `resolve_local` never takes an interrupted
    pull for a complete model.
    """
    check_repo_id(repo_id)
    if hf_offline():
        try:
            return resolve_local(repo_id, revision)
        except ViasdError:
            raise no_network_error(repo_id, "offline mode is on (HF_HUB_OFFLINE=1; unset it to download)") from None
    plan = plan_pull(repo_id, revision, head=head)
    console = _stderr_console() if progress else None
    if plan.up_to_date:
        if console:
            console.print(f"{repo_id}{rev_text(revision)}: already in the cache")
        return plan.snapshot

    cache = hf_cache_dir()
    check_disk_space(plan.bytes_to_fetch, cache, what=f"{repo_id}{rev_text(revision)}")
    cache.mkdir(parents=True, exist_ok=True)
    if console:
        console.print(
            f"{repo_id}{rev_text(revision)}: downloading {len(plan.missing)} of {len(plan.files)} files "
            f"({format_bytes(plan.bytes_to_fetch)}) into {cache}"
        )

    with _download_bar(console, repo_id, sum(f.size for f in plan.missing)) as bar:
        with hub_errors(repo_id, revision):
            for remote in plan.missing:  # weights first, config.json last (see select_files)
                bar.describe(f"{repo_id}: {remote.name}")
                hf_hub_download(
                    repo_id, remote.name, revision=plan.commit, cache_dir=cache, tqdm_class=bar
                )
            if not plan.ref_ok:
                # Resolving the branch once more through huggingface_hub writes its ref
                # (refs/<revision>); config.json is already cached, so nothing is downloaded.
                config = Path(hf_hub_download(repo_id, "config.json", revision=revision or "main", cache_dir=cache))
                if config.parent.name != plan.commit:
                    raise ViasdError(
                        f"{repo_id}{rev_text(revision)} changed on the Hub during the pull; run "
                        f"{pull_hint(repo_id, revision)} again"
                    )
    return plan.snapshot


def pull_file(repo_id: str, remote: RemoteFile, commit: str, revision: str | None = None, progress: bool = True,
              what: str | None = None) -> Path:
    """Download one file of `repo_id` (`remote`, as hub_plan.list_files listed it at `commit`) into the
    HF cache with pull's rules: free disk space checked first, a Rich bar on stderr, an interrupted
    download resumed; the branch ref written (resolving `revision`, default main, through
    huggingface_hub). Returns its path in the snapshot. `what`: the reference as the user gave it."""
    what = what or repo_id
    cache = hf_cache_dir()
    console = _stderr_console() if progress else None
    if is_cached_file(repo_id, remote.name, commit) and ref_points_to(repo_id, revision, commit):
        if console:
            console.print(f"{what}{rev_text(revision)}: already in the cache")
        return repo_folder(repo_id) / "snapshots" / commit / remote.name
    to_fetch = max(0, remote.size - partial_bytes(repo_id, remote.blob_name))
    check_disk_space(to_fetch, cache, what=f"{what}{rev_text(revision)}")
    cache.mkdir(parents=True, exist_ok=True)
    if console:
        console.print(f"{what}{rev_text(revision)}: downloading {remote.name} ({format_bytes(to_fetch)}) into {cache}")
    with _download_bar(console, f"{repo_id}: {remote.name}", remote.size) as bar, hub_errors(repo_id, revision):
        # by the branch's name, not the commit: huggingface_hub writes the ref as it resolves it
        return Path(hf_hub_download(repo_id, remote.name, revision=revision or "main", cache_dir=cache, tqdm_class=bar))


def fetch(repo_id: str, revision: str | None = None, progress: bool = True, head: bool = False) -> Path:
    """The local snapshot of `repo_id` at `revision`: the cached one when complete (no network call),
    else `pull`ed now (what `-m org/name` and `-d org/name` do on first use). Offline and not
    cached: pull's one-line error naming the id."""
    try:
        return resolve_local(repo_id, revision)
    except ViasdError:
        return pull(repo_id, revision=revision, progress=progress, head=head)
