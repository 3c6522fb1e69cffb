"""GGUF files on the Hugging Face Hub as model references: one file of a GGUF repo, named the way
llama.cpp and Ollama users name it, downloaded into the HF cache and then run as a local `.gguf` file.

Accepted spellings (`parse`; `hf.co/` in front is accepted too, as Ollama writes it):
  org/name:QUANT          llama.cpp's `-hf repo:quant`: the repo's .gguf file whose name holds the
                          tag QUANT, case-insensitively (`pick`).
  org/name/path/FILE.gguf one file of the repo, by its path in the repo.

A reference that exists as a local path is a local path, never one of these. A plain `org/name`
is a transformers repo (hub.py); a GGUF repo named that way is refused by hub_plan.plan_pull with
these spellings as the fix.

The file is taken from the cache when there (no Hub call, as for `-m org/name`); else the repo is
listed once and the file downloaded (hub_pull.pull_file: disk check, progress, resume, the
revision's ref written; HF_HUB_OFFLINE, the token and the cache folder as huggingface_hub reads
them). `viasd pull` always lists the repo (`pull_gguf`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from viasd_core.errors import ViasdError
from viasd_core.loading.hub import hf_cache_dir, hf_offline, rev_text, well_formed_repo_id

SUFFIX = ".gguf"
_OLLAMA_PREFIX = "hf.co/"
_WITH_QUANT = re.compile(r"^(?P<repo>[^/:\s]+/[^/:\s]+):(?P<quant>[A-Za-z0-9][A-Za-z0-9_.-]*)$")
_WITH_FILE = re.compile(r"^(?P<repo>[^/:\s]+/[^/:\s]+)/(?P<file>[^:\s]+)$")


@dataclass(frozen=True)
class HubGguf:
    repo_id: str
    quant: str | None  # org/name:QUANT
    filename: str | None  # org/name/FILE.gguf: the file's path in the repo

    @property
    def text(self) -> str:
        """The reference in its own spelling (for messages)."""
        return f"{self.repo_id}:{self.quant}" if self.quant else f"{self.repo_id}/{self.filename}"


def parse(ref: str) -> HubGguf | None:
    """The hub GGUF reference `ref` spells, or None (a local path, a plain hub id, anything else)."""
    ref = (ref or "").strip()
    if not ref or Path(ref).expanduser().exists():
        return None
    if ref.lower().startswith(_OLLAMA_PREFIX):
        ref = ref[len(_OLLAMA_PREFIX):]
    if match := _WITH_QUANT.match(ref):
        found = HubGguf(match["repo"], match["quant"], None)
    elif (match := _WITH_FILE.match(ref)) and match["file"].lower().endswith(SUFFIX):
        found = HubGguf(match["repo"], None, match["file"])
    else:
        return None
    return found if well_formed_repo_id(found.repo_id) else None


def is_hub_gguf(ref: str) -> bool:
    return parse(ref) is not None


def _whole_tag(name: str, tag: str) -> bool:
    """True when `tag` stands in the file name `name` as a whole part: between `-`, `.` or the ends
    (so Q4_0 is whole in `m-Q4_0.gguf` and not in `m-Q4_0_4_4.gguf`)."""
    return re.search(rf"(?:^|[-.]){re.escape(tag.lower())}(?:[-.]|$)", name.lower()) is not None


def pick(ref: HubGguf, names: list[str], where: str) -> str:
    """The file `ref` names among the repo's file `names` (`where`: where the list came from, for
    messages); a one-line error listing the .gguf files when none or several fit.

    A quant tag picks the .gguf file whose name (not its folder) contains the tag, case-insensitively;
    where several do, the one where it is a whole part of the name (`Q4_0` picks `m-Q4_0.gguf` over
    `m-Q4_0_4_4.gguf`). Vision projector files (`mmproj*`) are never picked by a tag."""
    ggufs = sorted(n for n in names if n.lower().endswith(SUFFIX))
    listed = ", ".join(ggufs) if ggufs else "none"
    if ref.filename is not None:
        if ref.filename in names:
            return ref.filename
        raise ViasdError(f"{ref.repo_id}{where} has no file {ref.filename}; its .gguf files: {listed}")
    candidates = [n for n in ggufs if not Path(n).name.lower().startswith("mmproj")]
    matches = [n for n in candidates if ref.quant.lower() in Path(n).name.lower()]
    if len(matches) > 1:
        whole = [n for n in matches if _whole_tag(Path(n).name, ref.quant)]
        matches = whole if len(whole) == 1 else matches
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ViasdError(f"no .gguf file of {ref.repo_id}{where} matches the tag {ref.quant}; its .gguf files: {listed}")
    raise ViasdError(
        f"the tag {ref.quant} matches {len(matches)} .gguf files of {ref.repo_id}{where}: {', '.join(matches)}; "
        f"give a longer tag, or the file as {ref.repo_id}/FILE.gguf"
    )


def cached_file(ref: HubGguf, revision: str | None = None) -> Path | None:
    """The file `ref` names in the local cache at `revision` (default main), or None; no Hub call.
    A quant tag is matched against the .gguf files of the cached snapshot."""
    cache = hf_cache_dir()
    if ref.filename is not None:
        found = try_to_load_from_cache(ref.repo_id, ref.filename, cache_dir=cache, revision=revision)
        return Path(found) if isinstance(found, str) and Path(found).is_file() else None
    try:
        snapshot = Path(snapshot_download(ref.repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                          allow_patterns=["*.gguf"]))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    try:
        return snapshot / pick(ref, names, " in the cache")
    except ViasdError:
        return None


def pull_gguf(ref: HubGguf, revision: str | None = None, progress: bool = True) -> Path:
    """`viasd pull` for a GGUF reference: list the repo on the Hub, then download the file unless
    cached. Offline (HF_HUB_OFFLINE=1): the cached file, else a one-line error naming the reference."""
    from viasd_core.loading import hub_plan, hub_pull

    if hf_offline():
        found = cached_file(ref, revision)
        if found is None:
            raise hub_plan.no_network_error(ref.repo_id, "offline mode is on (HF_HUB_OFFLINE=1; unset it to download)",
                                            what=ref.text + rev_text(revision))
        return found
    commit, files = hub_plan.list_files(ref.repo_id, revision)
    name = pick(ref, list(files), rev_text(revision))
    return hub_pull.pull_file(ref.repo_id, files[name], commit, revision=revision, progress=progress, what=ref.text)


def fetch_gguf(ref: HubGguf, revision: str | None = None, progress: bool = True) -> Path:
    """The local file of `ref`: the cached one (no Hub call), else `pull_gguf` now (first use)."""
    return cached_file(ref, revision) or pull_gguf(ref, revision, progress)


def gguf_file_ref(ref: str, revision: str | None = None, progress=None) -> str:
    """What `-m`/`-d` load for `ref`: for a hub GGUF reference, its .gguf file in the HF cache (downloaded
    on first use), which then runs as any local .gguf file (gguf_files.convert; `--quant gguf`); any
    other reference unchanged. `progress`: the loader's callback (bars unless it is quiet)."""
    from viasd_core.loading.progress import shows_progress

    hub_gguf = parse(ref)
    if hub_gguf is None:
        return ref
    return str(fetch_gguf(hub_gguf, revision, progress=shows_progress(progress)))
