"""Fixtures for the hub tests: a temporary HF cache, tiny model files, and a fake Hub.

Nothing here touches the network: `FakeHub` stands in for `HfApi().model_info` and
`hf_hub_download` and writes into the temporary cache with the real layout
(`models--org--name/{blobs,refs,snapshots}`), the way huggingface_hub does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

WORDS = ("hello", "world", "fast", "draft", "target", "token")


def tiny_model_files(words=WORDS, vocab_size: int = 64, sharded: bool = False) -> dict[str, bytes]:
    """config.json, safetensors weights (one file, or two shards + index) and a WordLevel tokenizer."""
    import tempfile

    import torch
    from safetensors.torch import save
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    files: dict[str, bytes] = {}
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    files["config.json"] = json.dumps(config).encode()
    files["generation_config.json"] = b'{"do_sample": false}'
    if sharded:
        files["model-00001-of-00002.safetensors"] = save({"a": torch.zeros(2)})
        files["model-00002-of-00002.safetensors"] = save({"b": torch.ones(3)})
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        files["model.safetensors.index.json"] = json.dumps(index).encode()
    else:
        files["model.safetensors"] = save({"embed": torch.zeros(vocab_size, 8)})

    vocab = {"[UNK]": 0, "[PAD]": 1} | {w: i + 2 for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with tempfile.TemporaryDirectory() as folder:
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(folder)
        for path in Path(folder).iterdir():
            files[path.name] = path.read_bytes()
    return files


def commit_of(label: str) -> str:
    """A deterministic 40-hex commit hash."""
    return hashlib.sha1(label.encode()).hexdigest()


def repo_folder(cache: Path, repo_id: str) -> Path:
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def blob_name(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def put_in_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str, refs=("main",)) -> Path:
    """Write `files` as the snapshot `commit` of `repo_id` (blobs + relative symlinks) and point `refs` at it."""
    folder = repo_folder(cache, repo_id)
    snapshot = folder / "snapshots" / commit
    for name, content in files.items():
        _write_blob_and_link(folder, snapshot, name, content)
    for ref in refs:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


def _write_blob_and_link(folder: Path, snapshot: Path, name: str, content: bytes) -> Path:
    blob = folder / "blobs" / blob_name(content)
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        tmp = blob.with_name(blob.name + ".incomplete")
        tmp.write_bytes(content)
        os.replace(tmp, blob)
    link = snapshot / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(os.path.relpath(blob, link.parent))
    return link


def _http_error(cls, message: str, status: int):
    import httpx2

    response = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))
    return cls(message, response=response)


class FakeHub:
    """Stands in for `HfApi` and `hf_hub_download`, counting calls; repos live in `self.repos`."""

    def __init__(self, cache: Path):
        self.cache = Path(cache)
        self.repos: dict[str, dict] = {}
        self.info_calls: list[tuple[str, str | None]] = []
        self.downloads: list[tuple[str, str, str | None]] = []
        self.connection_down = False

    def add(self, repo_id: str, files: dict[str, bytes], commit: str | None = None, refs=("main",), gated=False):
        commit = commit or commit_of(repo_id)
        repo = self.repos.setdefault(repo_id, {"commits": {}, "refs": {}, "gated": gated})
        repo["commits"][commit] = files
        for ref in refs:
            repo["refs"][ref] = commit
        return commit

    def install(self, monkeypatch):
        from viasd_core.loading import hub_plan, hub_pull

        monkeypatch.setattr(hub_plan, "HfApi", lambda *a, **k: self)
        monkeypatch.setattr(hub_pull, "hf_hub_download", self.hf_hub_download)
        return self

    # -- the two entry points viasd uses

    def _resolve(self, repo_id: str, revision: str | None) -> tuple[dict, str]:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        if self.connection_down:
            import httpx2

            raise httpx2.ConnectError("[Errno -3] Temporary failure in name resolution")
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _http_error(RepositoryNotFoundError, f"404 Client Error. Repository Not Found for url: {repo_id}", 404)
        if repo["gated"]:
            raise _http_error(GatedRepoError, f"403 Client Error. Cannot access gated repo {repo_id}", 403)
        revision = revision or "main"
        commit = revision if revision in repo["commits"] else repo["refs"].get(revision)
        if commit is None:
            raise _http_error(RevisionNotFoundError, f"404 Client Error. Revision Not Found: {revision}", 404)
        return repo, commit

    def model_info(self, repo_id, revision=None, files_metadata=False, **kwargs):
        from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling

        self.info_calls.append((repo_id, revision))
        repo, commit = self._resolve(repo_id, revision)
        siblings = []
        for name, content in repo["commits"][commit].items():
            lfs = BlobLfsInfo(size=len(content), sha256=blob_name(content), pointer_size=134) if name.endswith(".safetensors") else None
            siblings.append(RepoSibling(rfilename=name, size=len(content), blob_id=blob_name(content), lfs=lfs))
        return SimpleNamespace(id=repo_id, sha=commit, siblings=siblings)

    def hf_hub_download(self, repo_id, filename, *, revision=None, cache_dir=None, tqdm_class=None, **kwargs):
        self.downloads.append((repo_id, filename, revision))
        repo, commit = self._resolve(repo_id, revision)
        content = repo["commits"][commit][filename]
        folder = repo_folder(Path(cache_dir), repo_id)
        if revision and not re.fullmatch(r"[0-9a-f]{40}", revision):
            (folder / "refs").mkdir(parents=True, exist_ok=True)
            (folder / "refs" / revision).write_text(commit)
        if tqdm_class is not None:
            with tqdm_class(total=len(content), initial=0, desc=filename) as bar:
                bar.update(len(content))
        return str(_write_blob_and_link(folder, folder / "snapshots" / commit, filename, content))


@pytest.fixture(scope="session")
def model_files() -> dict[str, bytes]:
    return tiny_model_files()


@pytest.fixture(scope="session")
def other_model_files() -> dict[str, bytes]:
    """Same layout, a different vocabulary (two words swapped, one replaced)."""
    return tiny_model_files(words=("world", "hello", "fast", "draft", "target", "other"))


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """A temporary VIASD_HOME and HF cache, offline by default (tests that pull set HF_HUB_OFFLINE=0)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "viasd-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return SimpleNamespace(cache=cache, home=tmp_path / "viasd-home")


@pytest.fixture
def fake_hub(hub_env, monkeypatch) -> FakeHub:
    """A fake Hub, online (HF_HUB_OFFLINE=0), installed into viasd_core.loading.hub_plan and hub_pull."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return FakeHub(hub_env.cache).install(monkeypatch)


def disk_usage_with_free(free: int):
    """A replacement for shutil.disk_usage reporting `free` bytes free."""
    usage = SimpleNamespace(total=free * 2, used=free, free=free)
    return lambda path: usage


__all__ = [
    "FakeHub",
    "commit_of",
    "disk_usage_with_free",
    "fake_hub",
    "hub_env",
    "model_files",
    "other_model_files",
    "put_in_cache",
    "repo_folder",
    "tiny_model_files",
]
