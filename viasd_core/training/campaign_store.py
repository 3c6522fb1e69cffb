"""How the training campaign keeps its data: shards of token sequences (committed, compact) and shards
of the target's features and soft labels (a work folder, memory-mapped), every file written atomically.

A shard is done when its file (or folder) exists: it is written under a temporary name and renamed,
so a run killed at any point leaves either a whole shard or none, and a resumed run starts at the
first missing one.

- `SequenceShard` (`.npz`, no pickle): token sequences flat as uint16 when the vocabulary fits
  (else int32) with their offsets, each one's prompt length and the index of its prompt.
- `FeatureShard` (a folder of `.npy` files, memory-mapped): per token of the shard's sequences, the
  target's three layer states [P, 3H] (bfloat16 bits) and its top-k next-token ids and
  log-probabilities [P, K].
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


def _replace_atomically(tmp: Path, path: Path) -> None:
    """Rename a finished temporary file or folder into place (a folder replaces an existing one)."""
    if tmp.is_dir() and path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Compressed `.npz` of plain arrays, written to a temporary file and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        _replace_atomically(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


@dataclass
class SequenceShard:
    """Token sequences (prompt + answer) of one shard, in prompt order."""

    sequences: list[np.ndarray]  # each [prompt_len + n_new] int
    prompt_lens: list[int]
    prompt_index: list[int]  # the prompt's line in the campaign's prompts file

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def positions(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def generated(self) -> int:
        return sum(len(s) - p for s, p in zip(self.sequences, self.prompt_lens))

    def offsets(self) -> np.ndarray:
        """[n + 1] int64: sequence i is tokens[offsets[i] : offsets[i + 1]] of the flat array."""
        return np.concatenate([[0], np.cumsum([len(s) for s in self.sequences])]).astype(np.int64)

    def save(self, path: Path, vocab_size: int) -> None:
        dtype = np.uint16 if vocab_size <= 2 ** 16 else np.int32
        flat = np.concatenate(self.sequences) if self.sequences else np.zeros(0)
        save_npz(path, tokens=flat.astype(dtype), offsets=self.offsets(),
                 prompt_lens=np.asarray(self.prompt_lens, dtype=np.int32),
                 prompt_index=np.asarray(self.prompt_index, dtype=np.int32))

    @classmethod
    def load(cls, path: Path) -> "SequenceShard":
        d = load_npz(path)
        tokens, off = d["tokens"].astype(np.int64), d["offsets"]
        return cls([tokens[off[i] : off[i + 1]] for i in range(len(off) - 1)],
                   d["prompt_lens"].tolist(), d["prompt_index"].tolist())


FEATURES, TOP_IDS, TOP_LOGP = "features.npy", "top_ids.npy", "top_logp.npy"


def save_feature_shard(folder: Path, features: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> None:
    """Write one shard's [P, 3H] bfloat16 features and [P, K] top-k ids / log-probabilities as a folder
    (a temporary folder beside it, then a rename)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        np.save(tmp / FEATURES, features.to(torch.bfloat16).view(torch.int16).numpy())
        np.save(tmp / TOP_IDS, top_ids.to(torch.int32).numpy())
        np.save(tmp / TOP_LOGP, top_logp.float().numpy())
        _replace_atomically(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class FeatureShard:
    """A feature shard read lazily (memory-mapped): rows [start, end) of its token positions."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.features = np.load(self.folder / FEATURES, mmap_mode="r")
        self.top_ids = np.load(self.folder / TOP_IDS, mmap_mode="r")
        self.top_logp = np.load(self.folder / TOP_LOGP, mmap_mode="r")

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([n, 3H] bfloat16, [n, K] int64, [n, K] float32) of positions start..end-1."""
        feats = torch.from_numpy(np.array(self.features[start:end])).view(torch.bfloat16)
        return (feats, torch.from_numpy(np.array(self.top_ids[start:end])).long(),
                torch.from_numpy(np.array(self.top_logp[start:end])))


def chunks(items: Sequence, size: int) -> list[Sequence]:
    """`items` in consecutive shards of `size` (the last one shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]
