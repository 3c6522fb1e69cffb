"""How often each weight format's greedy token equals fp32 `ar`'s, teacher-forced on fp32's answers.

    python benchmarks/suites/format_agreement.py --results out/formats/none/results.jsonl \
        --prompts docs/results/cpu-prompts.jsonl [--formats bf16,int8,int4] [--threads 2] [--rows 1]

Reads fp32 `ar`'s answers from a `viasd bench` results file, then for every format feeds each
prompt + answer through the target at that format in one pass and counts the positions whose argmax
is fp32's token (the first answer token included). With `--rows r` the answer goes through passes of
r tokens after the prompt's prefill, as decoding (r = 1) or verify blocks feed it: the short passes'
kernels, where one pass over the whole answer takes the prefill's dense products. Prints JSON: agreement per format and per
category, positions counted. `bf16` is the unquantized model in bfloat16 (the activations the int
formats run with).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from viasd_core.loading.models import load_model
from viasd_core.runtime.model import FastModel
from viasd_core.loading.prompts import encode, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=0, help="answer tokens a pass after the prefill (0: one pass)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {r["prompt_id"]: r for r in map(json.loads, open(args.results, encoding="utf-8"))
            if r["method"] == "ar" and r["status"] == "ok" and r["repeat"] == 0}
    prompts = [p for p in load_prompts(args.prompts) if p.id in rows]
    out = {"model": args.model, "prompts": len(prompts), "rows_a_pass": args.rows or "all", "formats": {}}
    for fmt in args.formats.split(","):
        quant, dtype = ("none", "bfloat16") if fmt == "bf16" else (fmt, None)
        loaded = load_model(args.model, device="cpu", quant=quant, dtype=dtype)
        fm = FastModel(loaded.model, max_len=4096)
        hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for p in prompts:
            ids, answer = encode(loaded.tokenizer, p.text), rows[p.id]["tokens"]
            fm.reset()
            if args.rows:
                fed = torch.tensor(ids + answer[:-1])
                fm.forward(fed[: len(ids) - 1], 0)
                pred = torch.cat([fm.forward(fed[i : i + args.rows], i, min(args.rows, len(fed) - i)).argmax(-1)
                                  for i in range(len(ids) - 1, len(fed), args.rows)])
            else:
                pred = fm.forward(torch.tensor(ids + answer[:-1]), 0, len(answer)).argmax(-1)
            same = int((pred == torch.tensor(answer)).sum())
            for key in (p.category, "all"):
                hits[key][0] += same
                hits[key][1] += len(answer)
        out["formats"][fmt] = {"agreement": round(hits["all"][0] / hits["all"][1], 4), "positions": hits["all"][1],
                               "by_category": {c: round(h / n, 4) for c, (h, n) in sorted(hits.items()) if c != "all"}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
