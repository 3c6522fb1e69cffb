"""Distil a small draft from a target whose layers fit a Llama draft, trained on the target's own outputs.

Pipeline (each step a function, so `viasd distill`, the benchmark script and the tests share it):

1. `build_dataset`   batched generation with the target (teacher_answers.py). Every record keeps
                     the target's argmax at each generated position (the label), also when the
                     continuation itself was sampled.
2. `choose_vocab`    the Vd target ids most frequent among the labels -> `vocab_map` [Vd]
                     (teacher_answers.py).
3. `init_draft`      a few of the target's layers (copied), its final norm, and a head made of the
                     target's output rows for `vocab_map`; the embedding is the target's (shared)
                     (draft_init.py).
4. `train_draft`     cross-entropy on the target's argmax labels (over the Vd draft ids) (draft_train.py).
5. `evaluate_agreement` / `measure_cost`  top-1 agreement (teacher-forced) and decode cost ratio
                     (draft_eval.py).

This module holds the recipe: `DistillConfig`, its hyper-parameters (their defaults made the
shipped draft), and `run_distill`, which runs the whole recipe: what `viasd distill` does.

Seeds are fixed; runs are reproducible for a given thread count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from viasd_core.errors import UsageError
from viasd_core.loading.draft_model import save_draft
from viasd_core.loading.models import load_model, pad_token_id
from viasd_core.loading.prompts import load_prompts
from viasd_core.training.draft_eval import evaluate_agreement
from viasd_core.training.draft_init import check_target, default_layer_ids, init_draft
from viasd_core.training.draft_train import train_draft
from viasd_core.training.shared import check_out, resolve_bf16, save_or_fall_back
from viasd_core.training.teacher_answers import DEFAULT_PROMPTS, Record, build_dataset, choose_vocab, vocab_coverage


@dataclass
class DistillConfig:
    """The `viasd distill` recipe. The defaults are the values that made the shipped draft."""

    layers: int = 2  # decoder layers of the draft, copied from the target's first ones
    draft_vocab: int = 4096  # output vocabulary: the ids most frequent among the target's labels
    steps: int = 500
    batch_size: int = 8  # sequences per training step
    lr: float = 1e-3  # peak (AdamW, linear warm-up, cosine to 0.1x)
    warmup: int = 30
    weight_decay: float = 0.1
    time_limit_s: Optional[float] = None  # stop training after this long (the cosine follows time)
    bf16: Optional[bool] = None  # bfloat16 autocast, fp32 master weights; None: where it measures faster
    max_new_tokens: int = 128  # tokens the target generates per prompt
    generate_batch_size: int = 32  # prompts per batched generation
    sampled_every: int = 2  # also a sampled continuation for every k-th prompt from the 2nd; 0 = greedy only
    sampled_temperature: float = 0.8
    held_out_every: int = 20  # prompts with index % this == 0 are held out (greedy only) for early stopping
    eval_every: int = 50  # steps between held-out evaluations (and loss log lines)
    prompts: Optional[Path] = None  # JSONL or plain text; None = DEFAULT_PROMPTS
    eval_prompts: Optional[Path] = None  # measure top-1 agreement on these after training
    eval_limit: int = 80  # the first N evaluation prompts
    seed: int = 0  # sampling, initialisation and batch order
    threads: int = 1  # torch.set_num_threads

    def validate(self) -> None:
        """Raise a one-line UsageError naming the option (or field) whose value the recipe cannot use."""
        at_least = {"--layers": (self.layers, 1), "--draft-vocab": (self.draft_vocab, 16), "--steps": (self.steps, 1),
                    "--batch-size": (self.batch_size, 1), "--max-new-tokens": (self.max_new_tokens, 1),
                    "--sampled-every": (self.sampled_every, 0), "--eval-limit": (self.eval_limit, 1),
                    "--threads": (self.threads, 1), "warmup": (self.warmup, 0), "weight_decay": (self.weight_decay, 0),
                    "generate_batch_size": (self.generate_batch_size, 1), "held_out_every": (self.held_out_every, 1),
                    "eval_every": (self.eval_every, 1)}
        for name, (value, low) in at_least.items():
            if not value >= low:
                raise UsageError(f"{name} must be at least {low} (got {value})")
        positive = {"--lr": self.lr, "--time-limit": self.time_limit_s, "sampled_temperature": self.sampled_temperature}
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise UsageError(f"{name} must be > 0 (got {value})")

    def is_held_out(self, prompt_index: int) -> bool:
        """The held-out rule: these prompts (greedy continuation only) pick the best step."""
        return prompt_index % self.held_out_every == 0


def run_distill(target_ref: str, out: str | Path, config: DistillConfig, device: Optional[str] = None,
                trust_remote_code: bool = False, log: Callable[[str], None] = lambda msg: None) -> Path:
    """`viasd distill`: load the target (fp32), generate its data (greedy for every prompt, sampled
    for every `sampled_every`-th; the held-out prompts, greedy only, choose the best step), train
    the draft, measure its agreement on `eval_prompts` if given, and save it to `out` (atomically).
    Returns the draft folder. Every input (`out` too) is checked before the target is loaded; if
    `out` cannot be written at the end, the draft goes to a fallback folder the error names."""
    config.validate()
    out = check_out(out)
    prompts_path = Path(config.prompts) if config.prompts is not None else DEFAULT_PROMPTS
    prompts = load_prompts(prompts_path)
    evaluation = load_prompts(config.eval_prompts, limit=config.eval_limit) if config.eval_prompts is not None else None
    if all(config.is_held_out(i) for i in range(len(prompts))):
        raise UsageError(f"{prompts_path} has {len(prompts)} prompt(s), all held out for early stopping: give more prompts")
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    target = load_model(target_ref, dtype="float32", device=device, trust_remote_code=trust_remote_code)
    check_target(target.model)
    tok = target.tokenizer

    def generate(split: str, indices: list[int], temperature: float) -> list[Record]:
        return build_dataset(target, [prompts[i].text for i in indices], config.max_new_tokens,
                             batch_size=config.generate_batch_size, temperature=temperature, seed=config.seed,
                             categories=[prompts[i].category for i in indices],
                             progress=lambda i, n: log(f"{split}: {i}/{n} prompts"))

    t0 = time.perf_counter()
    greedy = generate("greedy", list(range(len(prompts))), 0.0)
    records = [r for i, r in enumerate(greedy) if not config.is_held_out(i)]
    held = [r for i, r in enumerate(greedy) if config.is_held_out(i) and r.labels.numel() > 0]
    if config.sampled_every > 0:
        k = config.sampled_every
        picked = [i for i in range(len(prompts)) if i % k == 1 % k and not config.is_held_out(i)]
        records += generate("sampled", picked, config.sampled_temperature)
    gen_s = time.perf_counter() - t0
    vocab_map = choose_vocab(records, config.draft_vocab, always=[tok.eos_token_id] if tok.eos_token_id is not None else [])
    n_labels = sum(r.labels.numel() for r in records)
    log(f"{len(records)} sequences, {n_labels} labels in {gen_s:.0f}s; draft vocab covers {vocab_coverage(records, vocab_map):.3f} of them")

    draft = init_draft(target.model, config.layers, vocab_map)
    bf16 = resolve_bf16(config.bf16, next(draft.parameters()).device, log)
    t1 = time.perf_counter()
    eval_fn = (lambda d: evaluate_agreement(d, held, vocab_map)["agreement"]) if held else None
    losses = train_draft(draft, records, vocab_map, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                         warmup=config.warmup, weight_decay=config.weight_decay, seed=config.seed,
                         pad_id=pad_token_id(target), log_every=config.eval_every, log=log,
                         time_limit_s=config.time_limit_s, bf16_autocast=bf16, eval_fn=eval_fn,
                         eval_every=config.eval_every)
    train_log = draft.viasd_train_log
    info = {
        "recipe": "viasd distill", "prompts": str(prompts_path), "records": len(records), "label_tokens": n_labels,
        "max_new_tokens": config.max_new_tokens, "sampled_every": config.sampled_every,
        "sampled_temperature": config.sampled_temperature if config.sampled_every else None,
        "layers_from_target": default_layer_ids(target.model.config.num_hidden_layers, config.layers),
        "steps": len(losses), "best_step": train_log["best_step"],
        "held_out": {"sequences": len(held), "rule": f"prompt index % {config.held_out_every} == 0",
                     "evals": train_log["evals"]},
        "warmup": config.warmup, "weight_decay": config.weight_decay, "batch_size": config.batch_size, "lr": config.lr,
        "bf16_autocast": bf16, "time_limit_s": config.time_limit_s, "seed": config.seed, "threads": config.threads,
        "generate_wall_s": round(gen_s, 1), "train_wall_s": round(time.perf_counter() - t1, 1),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "loss": "cross-entropy on the target's argmax labels over the draft vocabulary",
    }
    if evaluation is not None:
        records_eval = build_dataset(target, [p.text for p in evaluation], config.max_new_tokens,
                                     categories=[p.category for p in evaluation])
        scores = evaluate_agreement(draft, records_eval)
        info["eval"] = {k: v for k, v in scores.items() if k != "by_category"} | {"file": str(config.eval_prompts)}
        log(f"top-1 agreement {scores['agreement']:.3f} on {scores['prompts']} prompts")
    return save_or_fall_back(out, lambda folder: save_draft(folder, draft, vocab_map, tok,
                                                            target=str(target.model_id).replace("/", "--"), training=info))
