"""What row-invariant attention costs an int4 verify pass on a CPU.

    python benchmarks/experiments/row_attention.py --threads 2 --rounds 3

The embedded target at int4 (fused projections), passes over w tokens after 300 cached positions
(`pass_timing.time_passes`), three ways: "kernel" (viasd_kernels' row-invariant attention, one call
a layer: exact, what the engine runs where the kernel builds), "loop" (one SDPA call per position over
exactly its keys: exact, the reference and the fallback) and "one call" (one SDPA call for the pass:
not batch-invariant on a CPU, so not usable for sd == ar; timed only as a floor). Interleaved rounds;
each setting keeps its best. Prints one JSON object (docs/experiments/fused-projections-int4.md and docs/experiments/row-attention-one-call.md).
"""

from __future__ import annotations

import argparse
import json

import torch

from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_timing import time_passes
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,2,4,6,8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    model = FastModel(load_model("embedded", quant="int4", with_tokenizer=False).model, max_len=1024, name="target")
    best = {setting: {w: float("inf") for w in widths} for setting in ("kernel", "loop", "one call")}
    for _ in range(args.rounds):
        for setting in best:
            model.row_attention = setting != "one call"
            model.bind_kernels(row_kernel=setting == "kernel")
            for w, s in time_passes(model, widths, context=300, repeats=7).items():
                best[setting][w] = min(best[setting][w], s)
    print(json.dumps({"device": device_name(model.device), "threads": args.threads,
                      "ms": {k: {w: round(s * 1e3, 1) for w, s in v.items()} for k, v in best.items()}}, indent=1))


if __name__ == "__main__":
    main()
