"""What a short verify pass costs over int4 and int8 weights on a CPU, with and without
viasd_kernels' packed products.

    python benchmarks/experiments/packed_mm.py --threads 2 --rounds 3
    VIASD_MAX_CPU_ISA=avx2 python benchmarks/experiments/packed_mm.py --model smollm2-135m --widths 1,6 --context 64 --stat median

A target in each format (the embedded one unless --model; fused projections, row-invariant
attention), passes over w tokens after --context cached positions (`pass_timing.time_passes`), two
ways: "kernel" (viasd_kernels' cpu_packed_mm: each weight widened once a pass; AVX-512 BF16 pair dot
products where the CPU has them, the portable float32 FMA way elsewhere or under VIASD_MAX_CPU_ISA,
which the report's "way" names) and "pytorch" (PyTorch's `_weight_int4pack_mm_for_cpu` /
`_weight_int8pack_mm`: the fallback, dispatched for the same capped class). Interleaved rounds; each
setting keeps its best round (or the median of its rounds: --stat median). Prints one JSON object:
milliseconds by format, setting and width, each setting's w-token pass over its 1-token pass, and
PyTorch's time over the kernel's (docs/experiments/short-pass-products-read-once.md).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

import statistics

from viasd_core import paths
from viasd_core.runtime.packed_linear import PackedLinear
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_timing import time_passes
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model
from viasd_kernels import cpu_packed_mm, instruction_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,2,4,6,8,16")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stat", choices=("best", "median"), default="best")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    report = {"threads": args.threads, "model": args.model, "context": args.context, "stat": args.stat,
              "isa": instruction_set.describe_isa(), "aten": torch.backends.cpu.get_cpu_capability(),
              "way": cpu_packed_mm.way(paths.kernel_dir()), "ms": {}, "x_1_token": {}, "pytorch_over_kernel": {}}
    for fmt in args.formats.split(","):
        model = FastModel(load_model(args.model, quant=fmt, with_tokenizer=False, device="cpu").model, max_len=1024,
                          name="target")
        report["device"] = device_name(model.device)
        rounds = {setting: {w: [] for w in widths} for setting in ("kernel", "pytorch")}
        for _ in range(args.rounds):
            for setting in rounds:
                layers = [m for m in gc.get_objects() if isinstance(m, PackedLinear)]  # the model's and the fused ones
                for m in sorted(layers, key=lambda m: m.rows_of is not None):  # fused ones before the parts viewing them
                    m.bind(packed_kernel=setting == "kernel")  # bound again under the setting
                for w, s in time_passes(model, widths, context=args.context, repeats=args.repeats).items():
                    rounds[setting][w].append(s)
        pick = min if args.stat == "best" else statistics.median
        best = {k: {w: pick(v) for w, v in by_w.items()} for k, by_w in rounds.items()}
        report["ms"][fmt] = {k: {w: round(s * 1e3, 2) for w, s in v.items()} for k, v in best.items()}
        report["x_1_token"][fmt] = {k: {w: round(s / v[1], 3) for w, s in v.items()} for k, v in best.items()
                                    if 1 in v}
        report["pytorch_over_kernel"][fmt] = {w: round(best["pytorch"][w] / best["kernel"][w], 3) for w in widths}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
