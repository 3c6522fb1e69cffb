"""The recipe that made the shipped draft viasd_core/data/drafts/smollm2-135m/ (stages, cached under --work).

    python recipes/distill_smollm2.py gen --split greedy  --work /tmp/viasd_distill   # target greedy outputs
    python recipes/distill_smollm2.py gen --split sampled --work /tmp/viasd_distill   # target sampled outputs (T=0.8)
    python recipes/distill_smollm2.py gen --split dev     --work /tmp/viasd_distill   # Spec-Bench dev (evaluation only)
    python recipes/distill_smollm2.py train --work /tmp/viasd_distill --out viasd_core/data/drafts/smollm2-135m
    python recipes/distill_smollm2.py eval  --work /tmp/viasd_distill --draft viasd_core/data/drafts/smollm2-135m

The gen stages are independent and can run side by side (one thread each). Every stage uses
torch.set_num_threads(--threads) (default 1: the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from viasd_core.training import distill, draft_eval, draft_init, draft_train, teacher_answers
from viasd_core.loading.draft_model import load_draft, save_draft
from viasd_core.loading.models import load_model
from viasd_core.loading.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "viasd_core/data/distill_prompts.jsonl"
DEV = ROOT / "benchmarks/data/spec_bench_dev.jsonl"


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


def read_prompts(path: Path, limit: int | None = None):
    prompts = load_prompts(path, limit=limit)
    return [p.text for p in prompts], [p.category for p in prompts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["gen", "train", "eval"])
    ap.add_argument("--target", default="/tmp/conv/smol")
    ap.add_argument("--work", default="/tmp/viasd_distill")
    ap.add_argument("--split", choices=["greedy", "sampled", "dev"], default="greedy")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--name", default=None, help="gen: file name under --work (default: the split)")
    ap.add_argument("--every", type=int, default=1, help="gen: take every k-th prompt")
    ap.add_argument("--offset", type=int, default=0, help="gen: starting at this one")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gen-batch-size", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--time-limit", type=float, default=None, help="train: seconds (the cosine schedule follows time)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--intermediate", type=int, default=None, help="train: prune the draft's MLPs to this many neurons")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "viasd_core/data/drafts/smollm2-135m"))
    ap.add_argument("--draft", default=str(ROOT / "viasd_core/data/drafts/smollm2-135m"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.target, dtype="float32", device="cpu")
    target, tok = loaded.model, loaded.tokenizer

    if args.stage == "gen":
        dev = args.split == "dev"
        prompts, cats = read_prompts(DEV if dev else PROMPTS, args.limit)
        prompts, cats = prompts[args.offset :: args.every], cats[args.offset :: args.every]
        temp = 0.8 if args.split == "sampled" else 0.0
        t0 = time.perf_counter()
        recs = teacher_answers.build_dataset(
            loaded, prompts, args.max_new_tokens, batch_size=args.gen_batch_size, temperature=temp, seed=args.seed,
            categories=cats, progress=lambda i, n: log(f"{args.split}: {i}/{n} prompts"),
        )
        torch.save([r.to_dict() for r in recs], work / f"{args.name or args.split}.pt")
        log(f"{args.split}: {len(recs)} records, {sum(r.labels.numel() for r in recs)} labels, {time.perf_counter() - t0:.0f}s")
        return

    def records(split: str):
        return [teacher_answers.Record(**d) for d in torch.load(work / f"{split}.pt")]

    if args.stage == "train":
        # Hold out the prompts the recipe holds out (all their sequences) for early stopping.
        # Splits: greedy = every prompt; sampled / sampled_c = odd prompts; sampled_b = even prompts.
        parts = {"greedy": (0, 1), "sampled": (1, 2), "sampled_b": (0, 2), "sampled_c": (1, 2)}
        recipe = distill.DistillConfig()
        train, held = [], []
        for split, (offset, every) in parts.items():
            if not (work / f"{split}.pt").exists():
                continue
            for j, r in enumerate(records(split)):
                (held if recipe.is_held_out(offset + every * j) else train).append(r)
        held = [r for r in held if r.labels.numel() > 0]
        vocab_map = teacher_answers.choose_vocab(train, args.draft_vocab, always=[tok.eos_token_id])
        log(f"{len(train)} records, {sum(r.labels.numel() for r in train)} labels; vocab coverage {teacher_answers.vocab_coverage(train, vocab_map):.4f}")
        draft = draft_init.init_draft(target, args.layers, vocab_map, intermediate_size=args.intermediate)
        dev = records("dev")[:80] if (work / "dev.pt").exists() else None
        if dev:
            log(f"dev coverage {teacher_answers.vocab_coverage(dev, vocab_map):.4f}; agreement before training {draft_eval.evaluate_agreement(draft, records=dev[:20])['agreement']:.4f} (20 prompts)")
        t0 = time.perf_counter()
        eval_fn = lambda d: draft_eval.evaluate_agreement(d, records=held, vocab_map=vocab_map)["agreement"]
        log(f"{len(held)} held-out sequences")
        losses = draft_train.train_draft(
            draft, train, vocab_map, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
            pad_id=tok.pad_token_id or 0, log_every=25, log=log, time_limit_s=args.time_limit,
            warmup=args.warmup, bf16_autocast=True, eval_fn=eval_fn, eval_every=args.eval_every,
            weight_decay=args.weight_decay,
        )
        wall = time.perf_counter() - t0
        info = {
            "recipe": "recipes/distill_smollm2.py", "prompts": "viasd_core/data/distill_prompts.jsonl",
            "records": len(train), "label_tokens": sum(r.labels.numel() for r in train),
            "max_new_tokens": args.max_new_tokens, "sampled_temperature": 0.8, "sampled_every": 2,
            "bf16_autocast": True, "intermediate_size": draft.config.intermediate_size,
            "vocab": "most frequent target argmax ids, then the lowest unused ids (BPE merge order)", "warmup": args.warmup, "time_limit_s": args.time_limit,
            "layers_from_target": draft_init.default_layer_ids(target.config.num_hidden_layers, args.layers),
            "steps": len(losses), "best_step": draft.viasd_train_log["best_step"],
            "held_out": {"sequences": len(held), "rule": f"prompt index % {recipe.held_out_every} == 0", "evals": draft.viasd_train_log["evals"]},
            "weight_decay": args.weight_decay, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
            "threads": args.threads, "train_wall_s": round(wall, 1), "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4), "splits": [p for p in parts if (work / f"{p}.pt").exists()],
            "loss": "cross-entropy on the target's argmax labels over the draft vocabulary",
        }
        save_draft(args.out, draft, vocab_map, tok, target="smollm2-135m", training=info)
        log(f"saved {args.out}: {json.dumps(info)}")
        return

    if args.stage == "eval":
        draft = load_draft(args.draft, target, tokenizer=tok)
        dev = records("dev")[: args.limit] if args.limit else records("dev")
        res = draft_eval.evaluate_agreement(draft, records=dev)
        size = sum(p.stat().st_size for p in Path(args.draft).iterdir())
        cost = draft_eval.measure_cost(draft, target, steps=100, repeats=3)
        print(json.dumps({"agreement": res, "cost": cost, "size_bytes": size}, indent=1))


if __name__ == "__main__":
    main()
