"""`viasd distill`: make a draft for a target from the target's own outputs: a small draft model
(viasd_core.training.distill.run_distill) or an EAGLE-3 head (--kind feature: viasd_core.training.feature_distill)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from viasd_cli.app import app
from viasd_cli.options import DeviceOpt, TrustOpt, handle_errors
from viasd_core.training.distill import DistillConfig, run_distill
from viasd_core.training.eagle_train import HeadTrainConfig
from viasd_core.errors import UsageError
from viasd_core.training.feature_distill import FeatureDistillConfig, run_feature_distill

EXAMPLES = """
EXAMPLES

  viasd distill --target smollm2-135m --out ./my-draft                 # the shipped recipe (slow on CPU)

  viasd distill --target ./my-llama --out ./draft --layers 2 --draft-vocab 4096 --steps 500

  viasd distill --target ./my-llama --out ./draft --prompts prompts.jsonl --eval-prompts dev.jsonl --threads 2

  viasd distill --kind feature --target smollm2-135m --out ./head --work ./head-work   # an EAGLE-3 head

  viasd distill --kind feature --target ./my-llama --out ./head --work ./w --steps 3000 --draft-vocab 16384

A feature head is trained from one teacher-forced pass per batch of the target's answers; every
stage is cached in --work, so the same command resumes a run that was stopped.

Prompts files are JSON lines with a "prompt" field (and optionally "category"; Spec-Bench
files with "turns" work too) or plain text, one prompt per line. The draft folder is printed on
stdout, progress goes to stderr.
"""

DEFAULT = DistillConfig()
FEATURE = FeatureDistillConfig()
KINDS = ("model", "feature")


def _or(value, default):
    """An option's value, or the kind's default when it was not given."""
    return default if value is None else value


@app.command(epilog=EXAMPLES)
@handle_errors
def distill(
    target: Annotated[str, typer.Option("--target", help="The target: a local folder, a cached hub repo id, or 'smollm2-135m'.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the draft to (replaced atomically).")],
    kind: Annotated[str, typer.Option("--kind", help="model: a small draft model; feature: an EAGLE-3 head reading the target's features.")] = "model",
    work: Annotated[Optional[Path], typer.Option("--work", help="feature: folder caching every stage (needed to resume).")] = None,
    ttt_steps: Annotated[int, typer.Option("--ttt-steps", help="feature: draft steps unrolled in training (training-time test).")] = FEATURE.train.ttt_steps,
    layers: Annotated[int, typer.Option("--layers", help="Decoder layers of the draft (initialised from the target's).")] = DEFAULT.layers,
    draft_vocab: Annotated[Optional[int], typer.Option("--draft-vocab", help=f"Output vocabulary of the draft: the N ids most frequent in the target's outputs. [default: {DEFAULT.draft_vocab} (model), {FEATURE.draft_vocab} (feature)]")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help=f"Training steps (the weights with the best held-out agreement are kept). [default: {DEFAULT.steps} (model), {FEATURE.train.steps} (feature)]")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help=f"Sequences per training step. [default: {DEFAULT.batch_size} (model), {FEATURE.train.batch_size} (feature)]")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help=f"Peak learning rate (AdamW, cosine). [default: {DEFAULT.lr:g} (model), {FEATURE.train.lr:g} (feature)]")] = None,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="Stop training after this many seconds (the cosine schedule follows time).")] = DEFAULT.time_limit_s,
    bf16: Annotated[Optional[bool], typer.Option("--bf16/--fp32", help="Train with bfloat16 autocast (fp32 master weights), or in float32. [default: bfloat16 where it measures faster on this machine]")] = DEFAULT.bf16,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help=f"Tokens the target generates per prompt. [default: {DEFAULT.max_new_tokens} (model), {FEATURE.max_new_tokens} (feature)]")] = None,
    sampled_every: Annotated[int, typer.Option("--sampled-every", help=f"Also sample (T={DEFAULT.sampled_temperature:g}) a continuation for every k-th prompt (from the 2nd), labelled with the target's argmax; 0 = greedy only.")] = DEFAULT.sampled_every,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompts file (default: viasd's own distillation prompts).")] = DEFAULT.prompts,
    eval_prompts: Annotated[Optional[Path], typer.Option("--eval-prompts", help="Prompts file to measure top-1 agreement on after training.")] = DEFAULT.eval_prompts,
    eval_limit: Annotated[int, typer.Option("--eval-limit", help="Use the first N evaluation prompts.")] = DEFAULT.eval_limit,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling, initialisation and batch order.")] = DEFAULT.seed,
    threads: Annotated[int, typer.Option("--threads", help="CPU threads (torch.set_num_threads).")] = DEFAULT.threads,
    device: DeviceOpt = None,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Distil a draft from a target's own outputs: a small model (few layers, reduced vocabulary, shared
    embedding) or, with --kind feature, an EAGLE-3 head."""
    if kind not in KINDS:
        raise UsageError(f"unknown --kind '{kind}': use model or feature")
    if kind == "feature":
        if work is None:
            raise UsageError("--kind feature needs --work FOLDER (every stage is cached there, so a stopped run resumes)")
        t = FEATURE.train
        train = HeadTrainConfig(steps=_or(steps, t.steps), batch_size=_or(batch_size, t.batch_size), lr=_or(lr, t.lr),
                                time_limit_s=time_limit, bf16=bf16, ttt_steps=ttt_steps, seed=seed)
        fconfig = FeatureDistillConfig(draft_vocab=_or(draft_vocab, FEATURE.draft_vocab),
                                       max_new_tokens=_or(max_new_tokens, FEATURE.max_new_tokens), prompts=prompts,
                                       eval_prompts=eval_prompts, eval_limit=eval_limit, seed=seed, threads=threads, train=train)
        folder = run_feature_distill(target, out, fconfig, work, device=device, trust_remote_code=trust_remote_code,
                                     log=lambda msg: typer.echo(msg, err=True))
        typer.echo(str(folder))
        return
    config = DistillConfig(layers=layers, draft_vocab=_or(draft_vocab, DEFAULT.draft_vocab), steps=_or(steps, DEFAULT.steps),
                           batch_size=_or(batch_size, DEFAULT.batch_size), lr=_or(lr, DEFAULT.lr), time_limit_s=time_limit,
                           bf16=bf16, max_new_tokens=_or(max_new_tokens, DEFAULT.max_new_tokens), sampled_every=sampled_every,
                           prompts=prompts, eval_prompts=eval_prompts, eval_limit=eval_limit, seed=seed, threads=threads)
    folder = run_distill(target, out, config, device=device, trust_remote_code=trust_remote_code,
                         log=lambda msg: typer.echo(msg, err=True))
    typer.echo(str(folder))
