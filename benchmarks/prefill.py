"""Prompt prefill time: viasd's static-cache pass in each weight format vs transformers' own forward.

    python benchmarks/prefill.py --tokens 768 --formats none,int8,int4,int4-kernel --threads 2

One prompt of random token ids through `FastModel.forward` (chunks of 256, the last position's
logits), median of `--repeats` after one warm-up, and transformers' forward of the same ids in one
call (`logits_to_keep=1`, fp32) as the baseline. Prints one JSON object (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from viasd_core.decoding.model import FastModel
from viasd_core.decoding.pass_timing import call_seconds
from viasd_core.decoding.weight_format import WeightFormat
from viasd_core.decoding import weight_formats as wf
from viasd_core.decoding.weight_formats import packed_copy
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def median_ms(fn, repeats: int) -> float:
    return statistics.median(call_seconds(fn, repeats)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--formats", default="none,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.model, dtype="float32")
    ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    out = {"device": device_name(torch.device("cpu")), "threads": args.threads, "tokens": args.tokens, "ms": {}}
    with torch.inference_mode():
        out["ms"]["transformers fp32"] = median_ms(lambda: target.model(ids[None], logits_to_keep=1), args.repeats)
    for name in args.formats.split(","):
        # "int4-kernel": int4 with tinygemm's kernel for every pass (the path before the dense prefill)
        wf._int4_cpu_block_of.clear()
        dense = wf._int4_dense_cpu
        if name == "int4-kernel":
            wf._int4_dense_cpu = lambda *a: None
        fmt = name.removesuffix("-kernel")
        model = target.model if fmt == "none" else packed_copy(target.model, WeightFormat.parse(fmt))
        fast = FastModel(model, max_len=args.tokens + 32)

        def prefill():
            fast.reset()
            fast.forward(ids, 0, 1)

        out["ms"][f"viasd {name}"] = median_ms(prefill, args.repeats)
        wf._int4_dense_cpu = dense
    base = out["ms"]["transformers fp32"]
    out["x_transformers"] = {k: round(base / v, 2) for k, v in out["ms"].items()}
    out["tokens_per_s"] = {k: round(args.tokens / v * 1e3) for k, v in out["ms"].items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
