"""Stages 4 and 6 of the campaign: the head trained on the campaign's data, then fine-tuned on-policy.

Both run eagle_train.train_head, which writes a checkpoint (weights, optimizer state, step, the best
weights so far) every `checkpoint_every` steps and resumes from it, so a killed run loses at most
that many steps and ends with the same weights as an uninterrupted one. A stage is done when its
head folder exists (published layout, bfloat16, recipe and figures in config.json).

- `train_on_data`: a new head (eagle_init.init_head) over the 8192 ids the target emits most in the
  training sequences (chosen once, kept in the work folder), trained on them; the held-out
  prompts' greedy answers pick the best weights.
- `train_on_policy`: the data head, fine-tuned on a mix of the on-policy sequences (loss weighted
  towards the draft positions where its drafts were rejected) and as many training sequences.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from viasd_core.speculation.eagle import FeatureHead
from viasd_core.speculation.eagle_files import load_feature_head, save_feature_head
from viasd_core.errors import UsageError
from viasd_core.training import eagle_data, eagle_init, eagle_train, eagle_ttt
from viasd_core.training.campaign_features import CampaignRecords
from viasd_core.training.teacher_answers import choose_vocab


@dataclass
class TrainConfig:
    draft_vocab: int = 8192
    held_out_eval: int = 120  # held-out sequences scored at each evaluation (the first ones)
    # batches of similar length (runs of 50 batches sorted by length): the answers' lengths spread
    # widely (median 247 tokens, 90th percentile 479), so random batches compute ~1.6x the real positions
    data: eagle_train.HeadTrainConfig = field(default_factory=lambda: eagle_train.HeadTrainConfig(
        steps=6000, batch_size=8, lr=1e-3, warmup=100, ttt_steps=3, eval_every=500, checkpoint_every=50,
        group_by_length=50))
    on_policy: eagle_train.HeadTrainConfig = field(default_factory=lambda: eagle_train.HeadTrainConfig(
        steps=1200, batch_size=8, lr=3e-4, warmup=20, ttt_steps=3, eval_every=200, checkpoint_every=50,
        group_by_length=50))
    seed: int = 0


def _vocab(records: CampaignRecords, size: int, eos: Optional[int], path: Path) -> torch.Tensor:
    """The draft vocabulary, chosen from the training labels once and kept at `path` (a resumed run reuses it)."""
    if path.exists():
        return torch.from_numpy(np.load(path)).long()
    labels = [SimpleNamespace(labels=records.labels(n)) for n in range(len(records))]
    vocab = choose_vocab(labels, size, always=[eos] if eos is not None else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.npy")
    np.save(tmp, vocab.numpy())
    tmp.replace(path)
    return vocab


def _held_score(held: Sequence[eagle_data.FeatureRecord]) -> Callable[[FeatureHead], float]:
    return lambda h: eagle_ttt.evaluate_head(h, held)["agreement"][0]


def _save(head: FeatureHead, folder: Path, info: dict) -> Path:
    head.config_dict["viasd_training"] = info
    return save_feature_head(head.to(torch.bfloat16), folder)


def train_on_data(model, layers: Sequence[int], train: CampaignRecords, held: CampaignRecords, config: TrainConfig,
                  work: Path, eos: Optional[int], log: Callable[[str], None], target_format: str = "none") -> Path:
    """Train (or resume) the head on `train`; returns its folder (`work/heads/data`). Its
    `viasd_training` record names the target's weight format the data came from (`target_format`). With
    `config.data.extend`, a finished training planned for fewer steps goes on (a warm restart); the
    head it had made is kept as `work/heads/data-<its steps>`, and whatever the on-policy stage made
    from that head is moved to `work/on_policy-from-data-<its steps>/`."""
    folder = work / "heads" / "data"
    checkpoint = work / "train" / "head.ckpt"
    if folder.exists():
        done = torch.load(checkpoint, weights_only=True)["state"]["step"] if checkpoint.exists() else None
        if config.data.extend and done is not None and done > config.data.steps:
            raise UsageError(f"the data training already ran {done} steps: extend it to more than that")
        if not (config.data.extend and done is not None and done < config.data.steps):
            log(f"train: {folder} exists")
            return folder
        earlier = folder.with_name(f"data-{done}")
        if earlier.exists():  # a restarted extension: that head was kept already
            shutil.rmtree(folder)
        else:
            folder.rename(earlier)
        # what the on-policy stage made from the earlier head would pass for the new one's: set aside
        aside = work / f"on_policy-from-data-{done}"
        for part in (work / "heads" / "on_policy", work / "train" / "on_policy.ckpt", work / "on_policy"):
            if part.exists():
                aside.mkdir(exist_ok=True)
                part.rename(aside / part.name)
        log(f"train: extending the data training from step {done} to {config.data.steps}; the earlier head is {earlier}"
            + (f", its on-policy outputs are in {aside}" if aside.exists() else ""))
    vocab = _vocab(train, config.draft_vocab, eos, work / "train" / "vocab.npy")
    head = eagle_init.init_head(model, layers, vocab, seed=config.seed)
    held_few = [held[n] for n in range(min(config.held_out_eval, len(held)))]
    all_pos, gen_pos = train.positions()
    log(f"train: {len(train)} sequences ({all_pos} positions, {gen_pos} generated), {len(held)} held out")
    result = eagle_train.train_head(head, train, config.data, checkpoint=checkpoint,
                                    eval_fn=_held_score(held_few) if held_few else None, log=log,
                                    lengths=train.lengths())
    info = {"recipe": "viasd training campaign: data", "target_format": target_format,
            "sequences": len(train), "positions": all_pos,
            "generated_positions": gen_pos, "held_out_sequences": len(held), "feature_layers": list(layers),
            "train": {k: v for k, v in result.items() if k != "losses"}, "config": asdict(config.data)}
    return _save(head, folder, info)


def rejection_focus(rejections: dict[str, list[tuple[int, int, int]]], steps: int, boost: float):
    """focus(shard, i, L) for CampaignRecords: 1 everywhere, 1 + boost at head position t - 2 and step j
    for each rejection (sequence i, token position t, draft index j < steps)."""
    by_seq: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for name, rows in rejections.items():
        for i, t, j in rows:
            if j < steps and t >= 2:
                by_seq.setdefault((name, i), []).append((t - 2, j))

    def focus(name: str, i: int, length: int) -> torch.Tensor:
        w = torch.ones(length, steps)
        for q, j in by_seq.get((name, i), ()):
            if q < length:
                w[q, j] += boost
        return w
    return focus


class Mixed(Sequence[eagle_data.FeatureRecord]):
    """The on-policy sequences followed by as many training sequences (drawn once, seeded)."""

    def __init__(self, on_policy: CampaignRecords, train: CampaignRecords, seed: int):
        self.a, self.b = on_policy, train
        self.pick = random.Random(seed).sample(range(len(train)), min(len(on_policy), len(train)))

    def __len__(self) -> int:
        return len(self.a) + len(self.pick)

    def __getitem__(self, n: int) -> eagle_data.FeatureRecord:  # type: ignore[override]
        return self.a[n] if n < len(self.a) else self.b[self.pick[n - len(self.a)]]

    def lengths(self) -> list[int]:
        """Each sequence's token count (no feature read)."""
        b = self.b.lengths()
        return self.a.lengths() + [b[i] for i in self.pick]


def train_on_policy(model, data_head: Path, on_policy: CampaignRecords, train: CampaignRecords,
                    held: CampaignRecords, config: TrainConfig, work: Path, log: Callable[[str], None]) -> Path:
    """Fine-tune the data head on its own rejected positions (mixed with training data); returns
    `work/heads/on_policy`."""
    folder = work / "heads" / "on_policy"
    if folder.exists():
        log(f"on-policy training: {folder} exists")
        return folder
    head = load_feature_head(data_head, model.config, embed=model.get_input_embeddings(), dtype=torch.float32)
    info = dict(head.config_dict.get("viasd_training", {}))
    held_few = [held[n] for n in range(min(config.held_out_eval, len(held)))]
    mixed = Mixed(on_policy, train, config.seed)
    log(f"on-policy training: {len(on_policy)} on-policy sequences + {len(mixed) - len(on_policy)} training sequences")
    result = eagle_train.train_head(head, mixed, config.on_policy, checkpoint=work / "train" / "on_policy.ckpt",
                                    eval_fn=_held_score(held_few) if held_few else None, log=log,
                                    lengths=mixed.lengths())
    info["on_policy"] = {"sequences": len(on_policy), "mixed_with": len(mixed) - len(on_policy),
                         "train": {k: v for k, v in result.items() if k != "losses"}, "config": asdict(config.on_policy)}
    return _save(head, folder, info)
