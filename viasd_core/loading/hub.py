"""Hugging Face Hub models in the local cache: hub ids, the cache folder, offline mode, cached snapshots.

Everything here works on the standard huggingface_hub cache (`HF_HUB_CACHE`, default
`~/.cache/huggingface/hub`), laid out as `models--org--name/{blobs,refs,snapshots}/...`, so a
model pulled by viasd is also visible to transformers and the `hf` CLI, and the other way round.

Glossary:
  snapshot  the folder `snapshots/<commit>/` of one repo: symlinks to the files of one commit.
  ref       `refs/<branch or tag>`: a text file holding the commit a branch or tag pointed to.

Fetching from the Hub is in hub_pull.py, the tokenizer check of a target/draft pair in
vocab_check.py. Every user-facing problem is raised as a one-line `ViasdError` naming the
problem and the fix.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

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

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUTHY = {"1", "on", "yes", "true"}


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


def repo_folder(repo_id: str) -> Path:
    return hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def rev_text(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def pull_hint(repo_id: str, revision: str | None) -> str:
    return f"`viasd pull {repo_id}" + (f" --revision {revision}`" if revision else "`")


# ---------------------------------------------------------------------------------------------
# The local cache


def well_formed_repo_id(repo_id: str) -> bool:
    """The hub's id syntax: `org/name`, letters, digits, `_.-`, no `..`, no trailing `.` or `-`."""
    return bool(_REPO_ID.match(repo_id)) and ".." not in repo_id and not repo_id.endswith((".", "-"))


def is_repo_id(ref: str) -> bool:
    """True when `ref` is a well-formed hub id (`org/name`) and not an existing local path."""
    return well_formed_repo_id(ref) and not Path(ref).expanduser().exists()


def check_repo_id(repo_id: str) -> None:
    if not well_formed_repo_id(repo_id):
        raise UsageError(f"{repo_id!r} is not a hub model id; use the form org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct")


def resolve_local(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main) in the local cache; never uses the network.

    The snapshot must hold `config.json` and its weights (every shard named by a safetensors index):
    `pull` writes `config.json` last and the ref after it, so an interrupted pull is never taken
    for a complete one.
    """
    check_repo_id(repo_id)
    missing = ViasdError(
        f"model {repo_id}{rev_text(revision)} is not in the local cache ({hf_cache_dir()}); "
        f"run {pull_hint(repo_id, revision)}"
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
            f"the cached copy of {repo_id}{rev_text(revision)} is incomplete ({problem}); "
            f"run {pull_hint(repo_id, revision)} to finish it"
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
