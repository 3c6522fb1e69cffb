"""What `viasd pull` would fetch: list a repo on the Hugging Face Hub once and compare it with the cache.

Glossary:
  plan      the files generation needs (`select_files`, in download order), which of them are
            missing from the cache, and the bytes still to fetch.

`hub_errors` turns huggingface_hub's exceptions into one-line `ViasdError`s naming the problem
and the fix; hub_pull.py downloads the plan under it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, try_to_load_from_cache
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
from viasd_core.loading.hub import (
    CONFIG_FILES,
    TOKENIZER_PATTERNS,
    check_repo_id,
    hf_cache_dir,
    hf_offline,
    repo_folder,
    rev_text,
)

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


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
        return repo_folder(self.repo_id) / "snapshots" / self.commit

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
def hub_errors(repo_id: str, revision: str | None):
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
        raise no_network_error(repo_id, "the Hub cannot be reached") from None
    except LocalEntryNotFoundError:  # hf_hub_download: connection lost, file not cached
        raise no_network_error(repo_id, "the Hub cannot be reached") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            raise ViasdError(
                f"the Hub refused access to {repo_id} (HTTP 401); log in with `hf auth login` or set HF_TOKEN"
            ) from None
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ViasdError(f"the Hub failed while pulling {repo_id} ({first_line}); try again later") from None


def no_network_error(repo_id: str, why: str, what: str | None = None) -> ViasdError:
    """`what`: the reference as the user gave it, when it names more than the repo (a GGUF file)."""
    return ViasdError(
        f"cannot pull {what or repo_id}: {why}; pull it on a machine with network access "
        f"(or copy its models--{repo_id.replace('/', '--')} folder into {hf_cache_dir()})"
    )


def _read_ref(repo_id: str, revision: str) -> str | None:
    try:
        return (repo_folder(repo_id) / "refs" / revision).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def ref_points_to(repo_id: str, revision: str | None, commit: str) -> bool:
    """True when the cache's ref for `revision` (default main) points to `commit` (a commit needs no ref)."""
    return bool(_COMMIT.match(revision or "")) or _read_ref(repo_id, revision or "main") == commit


def list_files(repo_id: str, revision: str | None = None) -> tuple[str, dict[str, RemoteFile]]:
    """List the repo on the Hub (one API call): (the commit `revision` points to now, its files by name)."""
    check_repo_id(repo_id)
    if hf_offline():
        raise no_network_error(repo_id, "offline mode is on (HF_HUB_OFFLINE=1; unset it to download)")
    with hub_errors(repo_id, revision):
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    files = {}
    for sibling in info.siblings or []:
        lfs = getattr(sibling, "lfs", None)
        blob = getattr(lfs, "sha256", None) if lfs is not None else getattr(sibling, "blob_id", None)
        size = getattr(lfs, "size", None) if lfs is not None else None
        files[sibling.rfilename] = RemoteFile(name=sibling.rfilename, size=int(size or sibling.size or 0), blob_name=blob)
    return info.sha, files


def is_cached_file(repo_id: str, name: str, commit: str) -> bool:
    found = try_to_load_from_cache(repo_id, name, cache_dir=hf_cache_dir(), revision=commit)
    return isinstance(found, str) and os.path.isfile(found)


def partial_bytes(repo_id: str, blob_name: str | None) -> int:
    """Bytes already in the `.incomplete` blob an interrupted download left (0 when none)."""
    if not blob_name:
        return 0
    try:
        return (repo_folder(repo_id) / "blobs" / f"{blob_name}.incomplete").stat().st_size
    except OSError:
        return 0


def plan_pull(repo_id: str, revision: str | None = None, head: bool = False) -> PullPlan:
    """List the repo on the Hub (one API call) and work out what `pull` would fetch."""
    commit, listing = list_files(repo_id, revision)
    names = select_files(list(listing), head=head)
    if not any(n.endswith(".safetensors") or (head and n == "pytorch_model.bin") for n in names):
        ggufs = sorted(n for n in listing if n.lower().endswith(".gguf"))
        if ggufs:
            raise ViasdError(
                f"model {repo_id}{rev_text(revision)} is a GGUF repo (it has {', '.join(ggufs[:3])}"
                + (f" and {len(ggufs) - 3} more" if len(ggufs) > 3 else "")
                + f"): name one file, as {repo_id}:QUANT (e.g. {repo_id}:Q4_K_M) or {repo_id}/FILE.gguf"
            )
        others = sorted(n for n in listing if n.endswith((".bin", ".pt", ".pth")))
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise ViasdError(
            f"model {repo_id}{rev_text(revision)} has no safetensors weights{found}; "
            "viasd loads safetensors only: pick a repo that ships *.safetensors"
        )
    if "config.json" not in names:
        raise ViasdError(f"model {repo_id}{rev_text(revision)} has no config.json; it is not a transformers model")

    files = [listing[name] for name in names]
    missing = tuple(f for f in files if not is_cached_file(repo_id, f.name, commit))
    to_fetch = sum(max(0, f.size - partial_bytes(repo_id, f.blob_name)) for f in missing)
    ref_ok = ref_points_to(repo_id, revision, commit)
    return PullPlan(
        repo_id=repo_id,
        revision=revision,
        commit=commit,
        files=tuple(files),
        missing=missing,
        bytes_to_fetch=to_fetch,
        ref_ok=ref_ok,
    )
