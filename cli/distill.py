"""`viasd distill`: make a small draft for a target from the target's own outputs (the recipe:
viasd_core.distill.run_distill)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from viasd_cli.app import app
from viasd_cli.options import DeviceOpt, TrustOpt, handle_errors
from viasd_core.distill import DistillConfig, run_distill

EXAMPLES = """
EXAMPLES

  viasd distill --target smollm2-135m --out ./my-draft                 # the shipped recipe (slow on CPU)

  viasd distill --target ./my-llama --out ./draft --layers 2 --draft-vocab 4096 --steps 500

  viasd distill --target ./my-llama --out ./draft --prompts prompts.jsonl --eval-prompts dev.jsonl --threads 2

Prompts files are JSON lines with a "prompt" field (and optionally "category"; Spec-Bench
files with "turns" work too) or plain text, one prompt per line. The draft folder is printed on
stdout, progress goes to stderr.
"""

DEFAULT = DistillConfig()


@app.command(epilog=EXAMPLES)
@handle_errors
def distill(
    target: Annotated[str, typer.Option("--target", help="The target: a local folder, a cached hub repo id, or 'smollm2-135m'.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the draft to (replaced atomically).")],
    layers: Annotated[int, typer.Option("--layers", help="Decoder layers of the draft (initialised from the target's).")] = DEFAULT.layers,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="Output vocabulary of the draft: the N ids most frequent in the target's outputs.")] = DEFAULT.draft_vocab,
    steps: Annotated[int, typer.Option("--steps", help="Training steps (the weights with the best held-out agreement are kept).")] = DEFAULT.steps,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per training step.")] = DEFAULT.batch_size,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, cosine).")] = DEFAULT.lr,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="Stop training after this many seconds (the cosine schedule follows time).")] = DEFAULT.time_limit_s,
    bf16: Annotated[bool, typer.Option("--bf16/--fp32", help="Train with bfloat16 autocast (fp32 master weights).")] = DEFAULT.bf16,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens the target generates per prompt.")] = DEFAULT.max_new_tokens,
    sampled_every: Annotated[int, typer.Option("--sampled-every", help=f"Also sample (T={DEFAULT.sampled_temperature:g}) a continuation for every k-th prompt (from the 2nd), labelled with the target's argmax; 0 = greedy only.")] = DEFAULT.sampled_every,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompts file (default: viasd's own distillation prompts).")] = DEFAULT.prompts,
    eval_prompts: Annotated[Optional[Path], typer.Option("--eval-prompts", help="Prompts file to measure top-1 agreement on after training.")] = DEFAULT.eval_prompts,
    eval_limit: Annotated[int, typer.Option("--eval-limit", help="Use the first N evaluation prompts.")] = DEFAULT.eval_limit,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling, initialisation and batch order.")] = DEFAULT.seed,
    threads: Annotated[int, typer.Option("--threads", help="CPU threads (torch.set_num_threads).")] = DEFAULT.threads,
    device: DeviceOpt = None,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Distil a small draft (few layers, reduced vocabulary, shared embedding) from a target's own outputs."""
    config = DistillConfig(layers=layers, draft_vocab=draft_vocab, steps=steps, batch_size=batch_size, lr=lr,
                           time_limit_s=time_limit, bf16=bf16, max_new_tokens=max_new_tokens, sampled_every=sampled_every,
                           prompts=prompts, eval_prompts=eval_prompts, eval_limit=eval_limit, seed=seed, threads=threads)
    folder = run_distill(target, out, config, device=device, trust_remote_code=trust_remote_code,
                         log=lambda msg: typer.echo(msg, err=True))
    typer.echo(str(folder))
