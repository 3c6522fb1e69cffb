"""sd's adaptive block length against every fixed block length, in one process.

    python benchmarks/experiments/block_lengths.py --threads 2 -n 64 --rounds 1 > out.json

One session (the default pair and `--quant auto`), the 26 held-out prompts of
docs/results/cpu-prompts.jsonl, greedy, chains (no trees). Each prompt runs every method in turn
(`ar`; `sd` as `viasd generate` runs it without `-g`: adaptive from the first block measured on
this machine, session.choose_first_block; adaptive `sd` from each `--start` length, under each
`--cap` and with each `--min-confidence` stop; `sd --fixed -g G` for each G), and the rounds repeat
that, so the machine's drift falls on all methods alike. tokens/s is new tokens over the wall time of
the whole generate call (prefill included), as `viasd bench` reports it: the mean of the prompts'
rates (`x_ar`), and total tokens over total seconds (`total_x_ar`, also per category). Prints one
JSON object (docs/experiments/block-length-from-costs.md and docs/experiments/on-policy-head-block-cap.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from viasd_core.speculation.engine import GenerationConfig
from viasd_core.devices import device_name
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.prompts import encode, load_prompts
from viasd_core.session import build_session, choose_first_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--fixed", default="1,2,3,4")
    ap.add_argument("--start", default="", help="also adaptive sd from these first block lengths")
    ap.add_argument("--cap", default="", help="also adaptive sd with its block length capped at each of these "
                    "(first block min(5, cap))")
    ap.add_argument("--min-confidence", default="", help="also adaptive sd with these confidence stops (default: 0.15)")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", default="docs/results/cpu-prompts.jsonl")
    args = ap.parse_args()
    session = build_session(ModelOptions(threads=args.threads, quant=args.quant), mode="sd")
    n = args.max_new_tokens
    start = choose_first_block(session, GenerationConfig.gamma_max)
    methods = {"ar": GenerationConfig(mode="ar", max_new_tokens=n), "sd": GenerationConfig(mode="sd", max_new_tokens=n)}
    if start is not None:
        methods["sd"].start_at_measured(start)
    for g in (int(g) for g in args.start.split(",") if g):
        methods[f"sd -g {g}"] = GenerationConfig(mode="sd", max_new_tokens=n, gamma=g)
    for c in (int(c) for c in args.cap.split(",") if c):
        methods[f"sd --gamma-max {c}"] = GenerationConfig(mode="sd", max_new_tokens=n, gamma=min(5, c), gamma_max=c)
    for c in (float(c) for c in args.min_confidence.split(",") if c):
        methods[f"sd --min-confidence {c:g}"] = GenerationConfig(mode="sd", max_new_tokens=n, min_confidence=c)
    for g in map(int, args.fixed.split(",")):
        methods[f"sd --fixed -g {g}"] = GenerationConfig(mode="sd", max_new_tokens=n, gamma=g, adaptive=False)
    engine = session.engine
    listed = load_prompts(args.prompts)
    prompts = [encode(session.tokenizer, p.text) for p in listed]
    rates: dict[str, list[float]] = {m: [] for m in methods}
    tokens = {m: 0 for m in methods}
    passes = {m: 0 for m in methods}
    seconds = {m: 0.0 for m in methods}
    by_category: dict[str, dict[str, list[float]]] = {m: {} for m in methods}  # [tokens, seconds]

    def generate(name, ids):
        engine.reset()
        t = time.perf_counter()
        gen = engine.generate(ids, methods[name])
        return gen, time.perf_counter() - t

    for name in methods:  # warm-up
        generate(name, prompts[0])
    for _ in range(args.rounds):
        for p, ids in zip(listed, prompts):
            for name in methods:
                gen, took = generate(name, ids)
                rates[name].append(len(gen.tokens) / took)
                tokens[name] += len(gen.tokens)
                passes[name] += gen.stats.target_passes
                seconds[name] += took
                cat = by_category[name].setdefault(p.category or "", [0, 0.0])
                cat[0] += len(gen.tokens)
                cat[1] += took
    ar = statistics.mean(rates["ar"])
    out = {"device": device_name(engine.device), "threads": torch.get_num_threads(), "quant": session.options.quant,
           "draft": session.draft_id, "prompts": len(prompts), "rounds": args.rounds, "max_new_tokens": n,
           "first_block": session.first_block_record(),
           "methods": {}}
    for name in methods:
        mean = statistics.mean(rates[name])
        cats = {c: (t / s) / (by_category["ar"][c][0] / by_category["ar"][c][1]) for c, (t, s) in by_category[name].items()}
        low = min(cats, key=cats.get)
        out["methods"][name] = {"tokens_per_s": round(mean, 2), "std": round(statistics.stdev(rates[name]), 2),
                                "x_ar": round(mean / ar, 3), "tokens_per_pass": round(tokens[name] / passes[name], 3),
                                "total_tokens_per_s": round(tokens[name] / seconds[name], 2),
                                "total_x_ar": round((tokens[name] / seconds[name]) / (tokens["ar"] / seconds["ar"]), 3),
                                "lowest_category": [low, round(cats[low], 3)]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
