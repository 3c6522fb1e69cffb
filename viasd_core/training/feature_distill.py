"""`viasd distill --kind feature`: the recipe that trains an EAGLE-3 head for a target (eagle_train.py).

Every stage caches its result in a work folder, so a run killed at any point resumes where it
stopped (generation per split, teacher passes per split, training from its last checkpoint):

    greedy.pt / sampled.pt            the target's own answers to the prompts (teacher_answers.build_dataset)
    features-greedy.pt / -sampled.pt  one teacher-forced pass: features + top-k soft labels
    head.ckpt                         training state (weights, optimizer, step, best so far)
    eval.pt / features-eval.pt        the target's answers to the evaluation prompts (measured only)

Prompts with index % held_out_every == 0 are held out (their sequences pick the best weights);
evaluation prompts are never trained on. The head is written in the published layout
(eagle_files.save_feature_head), in bfloat16, with the recipe and its measurements in config.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from viasd_core.training import eagle_data, eagle_init, eagle_train, eagle_ttt
from viasd_core.training.teacher_answers import DEFAULT_PROMPTS, Record, build_dataset, choose_vocab
from viasd_core.speculation.eagle_files import save_feature_head
from viasd_core.errors import UsageError
from viasd_core.loading.models import load_model
from viasd_core.loading.prompts import load_prompts
from viasd_core.training.shared import check_out, save_or_fall_back


@dataclass
class FeatureDistillConfig:
    """The recipe; the defaults made the shipped head for the embedded target."""

    draft_vocab: int = 8192
    max_new_tokens: int = 192
    generate_batch_size: int = 32
    sampled: bool = True  # also one sampled answer per prompt
    sampled_temperature: float = 0.8
    held_out_every: int = 20
    teacher_batch_size: int = 8
    eval_steps: int = 8  # draft positions whose teacher-forced agreement is measured
    prompts: Optional[Path] = None  # None: teacher_answers.DEFAULT_PROMPTS
    eval_prompts: Optional[Path] = None
    eval_limit: int = 80
    seed: int = 0
    threads: int = 2
    train: eagle_train.HeadTrainConfig = field(default_factory=eagle_train.HeadTrainConfig)

    def validate(self) -> None:
        if self.draft_vocab < 16:
            raise UsageError(f"--draft-vocab must be at least 16 (got {self.draft_vocab})")
        for name, value in (("--steps", self.train.steps), ("--batch-size", self.train.batch_size),
                            ("--max-new-tokens", self.max_new_tokens), ("--threads", self.threads),
                            ("--ttt-steps", self.train.ttt_steps), ("--eval-limit", self.eval_limit)):
            if value < 1:
                raise UsageError(f"{name} must be at least 1 (got {value})")
        if not self.train.lr > 0:
            raise UsageError(f"--lr must be > 0 (got {self.train.lr})")


def _cached(path: Path, make: Callable[[], list], save: Callable, load: Callable, log) -> list:
    if path.exists():
        log(f"{path.name}: cached")
        return load(path)
    items = make()
    save(items, path)
    return items


def _load_records(path: Path) -> list[Record]:
    return [Record(**d) for d in torch.load(path, weights_only=True)]


def run_feature_distill(target_ref: str, out: str | Path, config: FeatureDistillConfig, work: str | Path,
                        device: Optional[str] = None, trust_remote_code: bool = False,
                        log: Callable[[str], None] = lambda msg: None) -> Path:
    """Train and save an EAGLE-3 head for `target_ref` (stages cached under `work`). Returns the head folder.
    `out` and `work` are checked before the target loads; if `out` cannot be written at the end,
    the head goes to a fallback folder the error names."""
    config.validate()
    out = check_out(out, work)
    prompts_path = Path(config.prompts) if config.prompts is not None else DEFAULT_PROMPTS
    prompts = load_prompts(prompts_path)
    evaluation = load_prompts(config.eval_prompts, limit=config.eval_limit) if config.eval_prompts is not None else None
    if len(prompts) < 2:
        raise UsageError(f"{prompts_path} has {len(prompts)} prompt(s): give at least 2")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    target = load_model(target_ref, dtype="float32", device=device, trust_remote_code=trust_remote_code)
    model = target.model
    layers = eagle_data.default_feature_layers(model.config.num_hidden_layers)
    timings: dict[str, float] = {}

    def generate(split: str, items, temperature: float) -> list[Record]:
        def make():
            t0 = time.perf_counter()
            recs = build_dataset(target, [p.text for p in items], config.max_new_tokens,
                                 batch_size=config.generate_batch_size, temperature=temperature, seed=config.seed + 1,
                                 categories=[p.category for p in items], progress=lambda i, n: log(f"{split}: {i}/{n} prompts"))
            timings[f"generate_{split}_s"] = round(time.perf_counter() - t0, 1)
            return recs
        return _cached(work / f"{split}.pt", make, eagle_data.save_records, _load_records, log)

    def features(split: str, records: list[Record]) -> list[eagle_data.FeatureRecord]:
        def make():
            t0 = time.perf_counter()
            seqs = [(r.input_ids.tolist(), r.prompt_len, r.category) for r in records]
            feats = eagle_data.teacher_pass(model, seqs, layers, batch_size=config.teacher_batch_size,
                                             progress=lambda i, n: log(f"teacher pass {split}: {i}/{n} sequences"))
            timings[f"teacher_{split}_s"] = round(time.perf_counter() - t0, 1)
            return feats
        return _cached(work / f"features-{split}.pt", make, eagle_data.save_records, eagle_data.load_records, log)

    held_out = [i % config.held_out_every == 0 for i in range(len(prompts))]
    train_recs: list[eagle_data.FeatureRecord] = []
    held: list[eagle_data.FeatureRecord] = []
    splits = [("greedy", 0.0)] + ([("sampled", config.sampled_temperature)] if config.sampled else [])
    for split, temperature in splits:
        feats = features(split, generate(split, prompts, temperature))
        for i, r in enumerate(feats):
            if held_out[i]:
                if split == "greedy":
                    held.append(r)
            else:
                train_recs.append(r)
    eos = target.tokenizer.eos_token_id
    vocab_map = choose_vocab(train_recs, config.draft_vocab, always=[eos] if eos is not None else [])
    labels = sum(r.tokens.numel() for r in train_recs)
    log(f"{len(train_recs)} training sequences ({labels} positions), {len(held)} held out; feature layers {layers}")
    head = eagle_init.init_head(model, layers, vocab_map, seed=config.seed)

    def held_agreement(h) -> float:
        return eagle_ttt.evaluate_head(h, held)["agreement"][0]

    train_log = eagle_train.train_head(head, train_recs, config.train, checkpoint=work / "head.ckpt",
                                       eval_fn=held_agreement if held else None, log=log)
    info = {"recipe": "viasd distill --kind feature", "prompts": prompts_path.name, "sequences": len(train_recs),
            "positions": labels, "held_out_sequences": len(held), "feature_layers": list(layers),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
            "train": {k: v for k, v in train_log.items() if k != "losses"}, "stage_seconds": timings,
            "loss": "soft cross-entropy to the target's top-20 distribution, training-time test over "
                    f"{config.train.ttt_steps} draft steps (weights 0.8^s)"}
    if held:
        info["held_out_agreement"] = eagle_ttt.evaluate_head(head, held, steps=config.eval_steps)["agreement"]
    if evaluation is not None:
        feats = features("eval", generate("eval", evaluation, 0.0))
        scores = eagle_ttt.evaluate_head(head, feats, steps=config.eval_steps)
        by_cat: dict[str, float] = {}
        for cat in sorted({r.category for r in feats}):
            by_cat[cat] = eagle_ttt.evaluate_head(head, [r for r in feats if r.category == cat])["agreement"][0]
        info["eval"] = {"file": Path(config.eval_prompts).name, "prompts": len(feats), "tokens": scores["tokens"],
                        "agreement_by_position": scores["agreement"], "first_position_by_category": by_cat}
        log(f"evaluation: first-position agreement {scores['agreement'][0]:.3f} on {len(feats)} prompts")
    head.config_dict["viasd_training"] = info
    head.to(torch.bfloat16)
    return save_or_fall_back(out, lambda folder: save_feature_head(head, folder))
