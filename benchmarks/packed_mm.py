"""What a short verify pass costs over int4 and int8 weights on a CPU, with and without
viasd_kernels' packed products.

    python benchmarks/packed_mm.py --threads 2 --rounds 3

The embedded target in each format (fused projections, row-invariant attention), passes over w
tokens after 300 cached positions (`pass_timing.time_passes`), two ways: "kernel" (viasd_kernels'
cpu_packed_mm: each weight widened once a pass, bfloat16 pair dot products; what the engine runs where
the CPU has AVX-512 BF16) and "pytorch" (PyTorch's `_weight_int4pack_mm_for_cpu` /
`_weight_int8pack_mm`: the fallback). Interleaved rounds; each setting keeps its best. Prints one
JSON object: milliseconds by format, setting and width, and each setting's w-token pass over its
1-token pass (docs/benchmarks.md section 30).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from viasd_core.decoding import weight_formats
from viasd_core.decoding.model import FastModel
from viasd_core.decoding.pass_timing import time_passes
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,2,4,6,8,16")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    report = {"threads": args.threads, "ms": {}, "x_1_token": {}}
    for fmt in args.formats.split(","):
        model = FastModel(load_model("embedded", quant=fmt, with_tokenizer=False).model, max_len=1024, name="target")
        report["device"] = device_name(model.device)
        best = {setting: {w: float("inf") for w in widths} for setting in ("kernel", "pytorch")}
        for _ in range(args.rounds):
            for setting in best:
                weight_formats.PACKED_KERNEL = setting == "kernel"
                for m in gc.get_objects():  # the model's layers and the fused ones beside them
                    if isinstance(m, weight_formats.PackedLinear):
                        m._short = None  # decide again under the setting
                for w, s in time_passes(model, widths, context=300, repeats=7).items():
                    best[setting][w] = min(best[setting][w], s)
        report["ms"][fmt] = {k: {w: round(s * 1e3, 2) for w, s in v.items()} for k, v in best.items()}
        report["x_1_token"][fmt] = {k: {w: round(s / v[1], 3) for w, s in v.items()} for k, v in best.items()}
    weight_formats.PACKED_KERNEL = True
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
