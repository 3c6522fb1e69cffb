"""`viasd distill`: make a small draft for a Llama-family target from the target's own greedy outputs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from viasd_cli.app import app
from viasd_cli.options import TrustOpt, handle_errors
from viasd_core.errors import UsageError, ViasdError

EXAMPLES = """
EXAMPLES

  viasd distill --target smollm2-135m --out ./my-draft                 # the shipped recipe (slow on CPU)

  viasd distill --target ./my-llama --out ./draft --layers 2 --draft-vocab 4096 --steps 500

  viasd distill --target ./my-llama --out ./draft --prompts prompts.jsonl --eval-prompts dev.jsonl --threads 2

Prompts files are JSON lines with a "prompt" field (and optionally "category"; Spec-Bench
files with "turns" work too). The draft folder is printed on stdout, progress goes to stderr.
"""


def _read_prompts(path: Path) -> tuple[list[str], list[str]]:
    prompts, cats = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror}")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise UsageError(f'{path}:{n} is not a JSON object with a "prompt" (or "turns") field')
        cats.append(str(row.get("category", "")))
    if not prompts:
        raise UsageError(f"{path} has no prompts")
    return prompts, cats


@app.command(epilog=EXAMPLES)
@handle_errors
def distill(
    target: Annotated[str, typer.Option("--target", help="The target: a local folder, a cached hub repo id, or 'smollm2-135m'.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the draft to (replaced atomically).")],
    layers: Annotated[int, typer.Option("--layers", help="Decoder layers of the draft (initialised from the target's).")] = 2,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="Output vocabulary of the draft: the N ids most frequent in the target's outputs.")] = 4096,
    steps: Annotated[int, typer.Option("--steps", help="Training steps (the weights with the best held-out agreement are kept).")] = 500,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per training step.")] = 8,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, cosine).")] = 1e-3,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="Stop training after this many seconds (the cosine schedule follows time).")] = None,
    bf16: Annotated[bool, typer.Option("--bf16/--fp32", help="Train with bfloat16 autocast (fp32 master weights).")] = True,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens the target generates per prompt.")] = 128,
    sampled_every: Annotated[int, typer.Option("--sampled-every", help="Also sample (T=0.8) a continuation for every k-th prompt (from the 2nd), labelled with the target's argmax; 0 = greedy only.")] = 2,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="JSONL prompts (default: viasd's own distillation prompts).")] = None,
    eval_prompts: Annotated[Optional[Path], typer.Option("--eval-prompts", help="JSONL prompts to measure top-1 agreement on after training.")] = None,
    eval_limit: Annotated[int, typer.Option("--eval-limit", help="Use the first N evaluation prompts.")] = 80,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling, initialisation and batch order.")] = 0,
    threads: Annotated[int, typer.Option("--threads", help="CPU threads (torch.set_num_threads).")] = 1,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu, cuda or cuda:N (default: cuda if available).")] = None,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Distil a small draft (few layers, reduced vocabulary, shared embedding) from a target's own outputs."""
    import torch

    from viasd_core import distill as core
    from viasd_core.draft_model import save_draft
    from viasd_core.loading import load_model

    if layers < 1 or draft_vocab < 16 or steps < 1:
        raise UsageError("--layers must be >= 1, --draft-vocab >= 16 and --steps >= 1")
    err = lambda msg: typer.echo(msg, err=True)  # noqa: E731
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    prompts = prompts or Path(core.__file__).parent / "data" / "distill_prompts.jsonl"
    texts, cats = _read_prompts(prompts)

    loaded = load_model(target, dtype="float32", device=device, trust_remote_code=trust_remote_code)
    model, tok = loaded.model, loaded.tokenizer
    if getattr(model.config, "model_type", "") not in ("llama", "mistral", "qwen2", "smollm3") or not hasattr(model, "model"):
        raise ViasdError(f"distill supports Llama-family targets; {target} is {getattr(model.config, 'model_type', '?')}")
    if tok is None:
        raise ViasdError(f"{target} has no tokenizer; distill needs one to apply the chat template")

    t0 = time.perf_counter()
    progress = lambda split: lambda i, n: err(f"{split}: {i}/{n} prompts")  # noqa: E731
    greedy = core.build_dataset(model, tok, texts, max_new_tokens, batch_size=32, temperature=0.0, seed=seed, categories=cats, progress=progress("greedy"))
    # prompts with index % 20 == 0 are held out (greedy only) for early stopping
    records = [r for i, r in enumerate(greedy) if i % 20 != 0]
    held = [r for i, r in enumerate(greedy) if i % 20 == 0 and r.labels.numel() > 0]
    if sampled_every > 0:
        picked = [i for i in range(len(texts)) if i % sampled_every == 1 % sampled_every and i % 20 != 0]
        records += core.build_dataset(model, tok, [texts[i] for i in picked], max_new_tokens, batch_size=32, temperature=0.8, seed=seed,
                                      categories=[cats[i] for i in picked], progress=progress("sampled"))
    gen_s = time.perf_counter() - t0
    vocab_map = core.choose_vocab(records, draft_vocab, always=[tok.eos_token_id] if tok.eos_token_id is not None else [])
    n_labels = sum(r.labels.numel() for r in records)
    err(f"{len(records)} sequences, {n_labels} labels in {gen_s:.0f}s; draft vocab covers {core.vocab_coverage(records, vocab_map):.3f} of them")

    draft = core.init_draft(model, layers, vocab_map)
    t1 = time.perf_counter()
    losses = core.train_draft(draft, records, vocab_map, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                              pad_id=tok.pad_token_id or 0, log_every=50, log=err,
                              warmup=30, time_limit_s=time_limit, bf16_autocast=bf16, weight_decay=0.1,
                              eval_fn=(lambda d: core.evaluate_agreement(d, records=held, vocab_map=vocab_map)["agreement"]) if held else None,
                              eval_every=50)
    info = {
        "recipe": "viasd distill", "prompts": str(prompts), "records": len(records), "label_tokens": n_labels,
        "max_new_tokens": max_new_tokens, "sampled_temperature": 0.8 if sampled_every else None, "sampled_every": sampled_every,
        "layers_from_target": core.default_layer_ids(model.config.num_hidden_layers, layers),
        "steps": len(losses), "best_step": getattr(draft, "viasd_train_log", {}).get("best_step"),
        "held_out": {"sequences": len(held), "rule": "prompt index % 20 == 0", "evals": getattr(draft, "viasd_train_log", {}).get("evals")},
        "weight_decay": 0.1, "batch_size": batch_size, "lr": lr, "bf16_autocast": bf16, "time_limit_s": time_limit, "seed": seed, "threads": threads,
        "generate_wall_s": round(gen_s, 1), "train_wall_s": round(time.perf_counter() - t1, 1),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "loss": "cross-entropy on the target's argmax labels over the draft vocabulary",
    }
    if eval_prompts is not None:
        ev_texts, ev_cats = _read_prompts(eval_prompts)
        ev = core.build_dataset(model, tok, ev_texts[:eval_limit], max_new_tokens, categories=ev_cats[:eval_limit])
        info["eval"] = {k: v for k, v in core.evaluate_agreement(draft, records=ev).items() if k != "by_category"}
        info["eval"]["file"] = str(eval_prompts)
        err(f"top-1 agreement {info['eval']['agreement']:.3f} on {info['eval']['prompts']} prompts")
    name = loaded.model_id if "/" not in str(loaded.model_id) else str(loaded.model_id).replace("/", "--")
    save_draft(out, draft, vocab_map, tok, target=name, training=info)
    typer.echo(str(out))
