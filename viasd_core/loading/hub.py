"""Hugging Face Hub models: find them in the local cache, pull what generation needs, check pairs.

Everything here works on the standard huggingface_hub cache (`HF_HUB_CACHE`, default
`~/.cache/huggingface/hub`), laid out as `models--org--name/{blobs,refs,snapshots}/...`, so a
model pulled by viasd is also visible to transformers and the `hf` CLI, and the other way round.

Glossary:
  snapshot  the folder `snapshots/<commit>/` of one repo: symlinks to the files of one commit.
  ref       `refs/<branch or tag>`: a text file holding the commit a branch or tag pointed to.
  plan      what `pull` would fetch: the files generation needs, and which of them are missing.

Every user-facing problem is raised as a one-line `ViasdError` naming the problem and the fix.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import OfflineModeIsEnabled

from viasd_core.errors import UsageError, ViasdError

# Files `pull` fetches (top-level files only: `original/` folders hold other formats).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "chat_template*",
)
GENERATION_PATTERNS = WEIGHT_PATTERNS + CONFIG_FILES + TOKENIZER_PATTERNS

# Free space `pull` keeps on top of the bytes it fetches: 512 MiB plus 5 %.
DISK_MARGIN_BYTES = 512 * 2**20
DISK_MARGIN_FRACTION = 0.05

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUTHY = {"1", "on", "yes", "true"}


def _connection_errors() -> tuple[type[BaseException], ...]:
    """Exception types meaning "the Hub cannot be reached" (the HTTP client differs between versions)."""
    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module_name in ("httpx2", "httpx", "requests"):
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        for name in ("ConnectError", "TimeoutException", "ConnectionError", "Timeout"):
            error = getattr(module, name, None)
            if isinstance(error, type) and issubclass(error, BaseException):
                errors.append(error)
    return tuple(errors)


_CONNECTION_ERRORS = _connection_errors()


# ---------------------------------------------------------------------------------------------
# Environment (read at call time: huggingface_hub reads its variables once, at import)


def hf_cache_dir() -> Path:
    """The huggingface_hub cache folder, honouring HF_HUB_CACHE and HF_HOME as set now."""
    value = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if value:
        return Path(value).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hf_offline() -> bool:
    """True when HF_HUB_OFFLINE is set (now, or when huggingface_hub was imported)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUTHY
    return bool(constants.HF_HUB_OFFLINE)


def _repo_folder(repo_id: str) -> Path:
    return hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def _rev_text(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def _pull_hint(repo_id: str, revision: str | None) -> str:
    return f"`viasd pull {repo_id}" + (f" --revision {revision}`" if revision else "`")


# ---------------------------------------------------------------------------------------------
# The local cache


def _well_formed(repo_id: str) -> bool:
    """The hub's id syntax: `org/name`, letters, digits, `_.-`, no `..`, no trailing `.` or `-`."""
    return bool(_REPO_ID.match(repo_id)) and ".." not in repo_id and not repo_id.endswith((".", "-"))


def is_repo_id(ref: str) -> bool:
    """True when `ref` is a well-formed hub id (`org/name`) and not an existing local path."""
    return _well_formed(ref) and not Path(ref).expanduser().exists()


def _check_repo_id(repo_id: str) -> None:
    if not _well_formed(repo_id):
        raise UsageError(f"{repo_id!r} is not a hub model id; use the form org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct")


def resolve_local(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main) in the local cache; never uses the network.

    The snapshot must hold `config.json` and its weights (every shard named by a safetensors index):
    `pull` writes `config.json` last and the ref after it, so an interrupted pull is never taken
    for a complete one.
    """
    _check_repo_id(repo_id)
    missing = ViasdError(
        f"model {repo_id}{_rev_text(revision)} is not in the local cache ({hf_cache_dir()}); "
        f"run {_pull_hint(repo_id, revision)}"
    )
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hf_cache_dir(),
                local_files_only=True,
                allow_patterns=list(GENERATION_PATTERNS),
            )
        )
    except HFValidationError as e:
        raise UsageError(f"{repo_id!r} is not a valid hub model id ({e}); use the form org/name") from None
    except LocalEntryNotFoundError:  # also IncompleteSnapshotError
        raise missing from None
    if not folder.is_dir():
        raise missing
    problem = _snapshot_problem(folder)
    if problem:
        raise ViasdError(
            f"the cached copy of {repo_id}{_rev_text(revision)} is incomplete ({problem}); "
            f"run {_pull_hint(repo_id, revision)} to finish it"
        )
    return folder


def _snapshot_problem(folder: Path) -> str | None:
    """Why a snapshot folder cannot be loaded, or None when it looks complete."""
    if not (folder / "config.json").is_file():
        return "no config.json"
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            return f"unreadable {indexes[0].name}"
        absent = sorted({name for name in weight_map.values() if not (folder / name).is_file()})
        if absent:
            return f"missing weight shard {absent[0]}" + (f" and {len(absent) - 1} more" if len(absent) > 1 else "")
        return None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return "no weights"
    return None


def is_cached(repo_id: str, revision: str | None = None) -> bool:
    """True when `resolve_local` would find the model."""
    try:
        resolve_local(repo_id, revision)
    except ViasdError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Pull


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int  # bytes
    blob_name: str | None  # the blob's file name in the cache (LFS sha256 or git oid), when known


@dataclass(frozen=True)
class PullPlan:
    repo_id: str
    revision: str | None  # as asked (None = main)
    commit: str  # the commit the revision points to now
    files: tuple[RemoteFile, ...]  # what generation needs, in download order
    missing: tuple[RemoteFile, ...]  # of those, the ones not in the cache
    bytes_to_fetch: int  # bytes of `missing`, less what partial (.incomplete) blobs already hold
    ref_ok: bool  # the cache's ref for `revision` already points to `commit`

    @property
    def snapshot(self) -> Path:
        return _repo_folder(self.repo_id) / "snapshots" / self.commit

    @property
    def up_to_date(self) -> bool:
        return not self.missing and self.ref_ok


def select_files(filenames: list[str], head: bool = False) -> list[str]:
    """The files of a repo listing that generation needs, in download order (config.json last).

    Only top-level files. Weights: the shards of a safetensors index when there is one, else
    `model.safetensors` when present (skipping e.g. a duplicate `consolidated.safetensors`),
    else every top-level `*.safetensors`. `head`: an EAGLE-3 draft head, published as
    `pytorch_model.bin` when it has no safetensors (read only with torch.load(weights_only=True)).
    """
    top = [f for f in filenames if "/" not in f]

    def matches(name: str, patterns) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    weights = [f for f in top if fnmatch.fnmatchcase(f, "*.safetensors")]
    indexes = sorted(f for f in top if f.endswith(".safetensors.index.json"))
    if indexes:
        prefix = indexes[0][: -len(".safetensors.index.json")]
        weights = [f for f in weights if f == f"{prefix}.safetensors" or f.startswith(f"{prefix}-")]
        indexes = indexes[:1]
    elif "model.safetensors" in weights:
        weights = ["model.safetensors"]
    others = [
        f
        for f in top
        if f not in CONFIG_FILES and not f.endswith(".safetensors") and not f.endswith(".safetensors.index.json")
        and matches(f, TOKENIZER_PATTERNS)
    ]
    configs = [f for f in ("generation_config.json", "config.json") if f in top]
    if head and not weights and "pytorch_model.bin" in top:
        weights = ["pytorch_model.bin"]
    return sorted(weights) + indexes + sorted(others) + configs


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None):
    """Turn huggingface_hub's exceptions into one-line ViasdErrors."""
    try:
        yield
    except GatedRepoError:
        raise ViasdError(
            f"model {repo_id} is gated: accept the licence on https://huggingface.co/{repo_id} "
            "and log in with `hf auth login` (or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ViasdError(
            f"model {repo_id} was not found on the Hugging Face Hub; check the id "
            "(for a private repo, log in with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ViasdError(
            f"revision {revision} of model {repo_id} does not exist on the Hub; check the branch, tag or commit"
        ) from None
    except HFValidationError as e:
        raise UsageError(f"{repo_id!r} is not a valid hub model id ({e}); use the form org/name") from None
    except _CONNECTION_ERRORS:
        raise _no_network_error(repo_id, "the Hub cannot be reached") from None
    except LocalEntryNotFoundError:  # hf_hub_download: connection lost, file not cached
        raise _no_network_error(repo_id, "the Hub cannot be reached") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            raise ViasdError(
                f"the Hub refused access to {repo_id} (HTTP 401); log in with `hf auth login` or set HF_TOKEN"
            ) from None
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ViasdError(f"the Hub failed while pulling {repo_id} ({first_line}); try again later") from None


def _no_network_error(repo_id: str, why: str) -> ViasdError:
    return ViasdError(
        f"cannot pull {repo_id}: {why}; pull it on a machine with network access "
        f"(or copy its models--{repo_id.replace('/', '--')} folder into {hf_cache_dir()})"
    )


def _read_ref(repo_id: str, revision: str) -> str | None:
    try:
        return (_repo_folder(repo_id) / "refs" / revision).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _is_cached_file(repo_id: str, name: str, commit: str) -> bool:
    found = try_to_load_from_cache(repo_id, name, cache_dir=hf_cache_dir(), revision=commit)
    return isinstance(found, str) and os.path.isfile(found)


def _partial_bytes(repo_id: str, blob_name: str | None) -> int:
    """Bytes already in the `.incomplete` blob an interrupted download left (0 when none)."""
    if not blob_name:
        return 0
    try:
        return (_repo_folder(repo_id) / "blobs" / f"{blob_name}.incomplete").stat().st_size
    except OSError:
        return 0


def plan_pull(repo_id: str, revision: str | None = None, head: bool = False) -> PullPlan:
    """List the repo on the Hub (one API call) and work out what `pull` would fetch."""
    _check_repo_id(repo_id)
    if hf_offline():
        raise _no_network_error(repo_id, "offline mode is on (HF_HUB_OFFLINE=1; unset it to download)")
    with _hub_errors(repo_id, revision):
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    names = select_files(list(siblings), head=head)
    if not any(n.endswith(".safetensors") or (head and n == "pytorch_model.bin") for n in names):
        others = sorted(n for n in siblings if n.endswith((".bin", ".pt", ".pth", ".gguf")))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise ViasdError(
            f"model {repo_id}{_rev_text(revision)} has no safetensors weights{found}; "
            "viasd loads safetensors only: pick a repo that ships *.safetensors"
        )
    if "config.json" not in names:
        raise ViasdError(f"model {repo_id}{_rev_text(revision)} has no config.json; it is not a transformers model")

    files = []
    for name in names:
        sibling = siblings[name]
        lfs = getattr(sibling, "lfs", None)
        blob = getattr(lfs, "sha256", None) if lfs is not None else getattr(sibling, "blob_id", None)
        size = getattr(lfs, "size", None) if lfs is not None else None
        files.append(RemoteFile(name=name, size=int(size or sibling.size or 0), blob_name=blob))
    commit = info.sha
    missing = tuple(f for f in files if not _is_cached_file(repo_id, f.name, commit))
    to_fetch = sum(max(0, f.size - _partial_bytes(repo_id, f.blob_name)) for f in missing)
    ref_ok = bool(_COMMIT.match(revision or "")) or _read_ref(repo_id, revision or "main") == commit
    return PullPlan(
        repo_id=repo_id,
        revision=revision,
        commit=commit,
        files=tuple(files),
        missing=missing,
        bytes_to_fetch=to_fetch,
        ref_ok=ref_ok,
    )


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
    _check_repo_id(repo_id)
    if hf_offline():
        try:
            return resolve_local(repo_id, revision)
        except ViasdError:
            raise _no_network_error(repo_id, "offline mode is on (HF_HUB_OFFLINE=1; unset it to download)") from None
    plan = plan_pull(repo_id, revision, head=head)
    console = _stderr_console() if progress else None
    if plan.up_to_date:
        if console:
            console.print(f"{repo_id}{_rev_text(revision)}: already in the cache")
        return plan.snapshot

    cache = hf_cache_dir()
    check_disk_space(plan.bytes_to_fetch, cache, what=f"{repo_id}{_rev_text(revision)}")
    cache.mkdir(parents=True, exist_ok=True)
    if console:
        console.print(
            f"{repo_id}{_rev_text(revision)}: downloading {len(plan.missing)} of {len(plan.files)} files "
            f"({format_bytes(plan.bytes_to_fetch)}) into {cache}"
        )

    with contextlib.ExitStack() as stack:
        bar = type("_Bar", (_ProgressAdapter,), {})
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
            bar.task = rich_progress.add_task(repo_id, total=sum(f.size for f in plan.missing))
        with _hub_errors(repo_id, revision):
            for remote in plan.missing:  # weights first, config.json last (see select_files)
                if bar.progress is not None:
                    bar.progress.update(bar.task, description=f"{repo_id}: {remote.name}")
                hf_hub_download(
                    repo_id, remote.name, revision=plan.commit, cache_dir=cache, tqdm_class=bar
                )
            if not plan.ref_ok:
                # Resolving the branch once more through huggingface_hub writes its ref
                # (refs/<revision>); config.json is already cached, so nothing is downloaded.
                config = Path(hf_hub_download(repo_id, "config.json", revision=revision or "main", cache_dir=cache))
                if config.parent.name != plan.commit:
                    raise ViasdError(
                        f"{repo_id}{_rev_text(revision)} changed on the Hub during the pull; run "
                        f"{_pull_hint(repo_id, revision)} again"
                    )
    return plan.snapshot


# ---------------------------------------------------------------------------------------------
# Pairs


SAME_FAMILY_FIX = "pick a draft from the same model family (see `viasd models`)"


def check_same_tokenizer(
    target_path: str | Path,
    draft_path: str | Path,
    target_name: str | None = None,
    draft_name: str | None = None,
) -> None:
    """Raise a ViasdError naming both models when the tokenizers saved in two folders differ."""
    target_name = target_name or str(target_path)
    draft_name = draft_name or str(draft_path)
    check_vocabularies(_load_vocab(target_path, target_name), _load_vocab(draft_path, draft_name), target_name, draft_name)


def check_vocabularies(target_vocab: dict[str, int], draft_vocab: dict[str, int], target_name: str, draft_name: str,
                       fix: str = SAME_FAMILY_FIX) -> None:
    """Raise a ViasdError naming both models (and `fix`) when two vocabularies (token -> id) differ.

    Speculative decoding compares token ids, so target and draft must map every token to the
    same id. Only the tokenizers are compared: a model whose embedding matrix has padding rows
    beyond the tokenizer (config vocab_size larger, like Qwen2.5-7B's 152064 for 151665 tokens)
    is fine.
    """
    if target_vocab == draft_vocab:
        return
    differing = sorted(
        (tok for tok in set(target_vocab) | set(draft_vocab) if target_vocab.get(tok) != draft_vocab.get(tok)),
        key=lambda tok: (min(target_vocab.get(tok, 1 << 62), draft_vocab.get(tok, 1 << 62)), tok),
    )
    example = differing[0]
    raise ViasdError(
        f"target {target_name} and draft {draft_name} use different tokenizers "
        f"({len(target_vocab)} vs {len(draft_vocab)} tokens, {len(differing)} differ, e.g. {example!r}: "
        f"id {target_vocab.get(example)} vs {draft_vocab.get(example)}); {fix}"
    )


def _load_vocab(path: str | Path, name: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ViasdError(f"cannot load the tokenizer of {name} from {path} ({first_line})") from None
    return dict(tokenizer.get_vocab())
