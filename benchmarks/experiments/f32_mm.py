"""What a short pass's float32 product costs on a CPU: viasd_kernels' row-invariant product against
PyTorch's three.

    python benchmarks/experiments/f32_mm.py --threads 2 --rounds 7

SmolLM2-135M's shapes (K=576: N = 576 q/o, 192 k/v, 1536 gate/up, 49152 lm_head; K=1536, N=576
down) with random weights, passes of 1, 2, 4, 6, 8 and 16 rows, four ways: "kernel" (cpu_f32_mm),
"blocked" (`torch.bmm` over 4 blocks of the weight's rows, short_products.py), "packed" (oneDNN's
product over a copy reordered once, `_linear_pointwise`) and "linear" (F.linear). In one process,
the ways alternated within each round; each cell is the median of every call's time over the rounds
("us"), and its 10th percentile ("p10_us": on a shared machine, the calls least disturbed). With
`--cold` each call reads a different copy of the weight (copies filling 4x `--cold` MB), so that the
weights come from memory as in a model's pass rather than from the cache. Prints one JSON object:
microseconds by shape, way and width.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from viasd_kernels import cpu_f32_mm

SHAPES = {"qo 576x576": (576, 576), "kv 192x576": (192, 576), "mlp 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def ways(w: torch.Tensor, build_dir: Path) -> dict:
    n = w.shape[0]
    bound = cpu_f32_mm.bind(w, build_dir=build_dir)
    assert bound is not None, cpu_f32_mm.why_not()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    blocks = w.view(4, n // 4, w.shape[1])
    return {
        "kernel": bound,
        "blocked": lambda x: torch.bmm(blocks, x.t().expand(4, *x.t().shape)).permute(2, 0, 1).reshape(x.shape[0], n),
        "packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "linear": lambda x: F.linear(x, w),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,2,4,6,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.05, help="time a way takes at a width in a round")
    ap.add_argument("--cold", type=float, default=0, help="MB of the last-level cache to defeat (0: hot weights)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    build_dir = Path(tempfile.mkdtemp(prefix="f32_mm_bench_"))
    report = {"threads": args.threads, "cold_mb": args.cold, "load": os.getloadavg()[0], "us": {}, "p10_us": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(1, int(4 * args.cold * 2**20 / (n * k * 4))) if args.cold else 1
        g = torch.Generator().manual_seed(n + k)
        weights = [torch.randn(n, k, generator=g) * k**-0.5 for _ in range(copies)]
        per_copy = [ways(w, build_dir) for w in weights]
        xs = {m: torch.randn(m, k, generator=g) for m in widths}
        for m in widths:  # every way gives the same products, within rounding
            want = F.linear(xs[m], weights[0]).double()
            for way, fn in per_copy[0].items():
                assert torch.allclose(fn(xs[m]).double(), want, rtol=1e-4, atol=1e-4), (name, way, m)
        samples = {way: {m: [] for m in widths} for way in per_copy[0]}
        for _ in range(args.rounds):
            for m in widths:
                for way in samples:
                    fns = [c[way] for c in per_copy]
                    x = xs[m]
                    for i in range(3):  # warm
                        fns[i % copies](x)
                    t_end = time.perf_counter() + args.seconds
                    while time.perf_counter() < t_end:
                        for f in fns:
                            t0 = time.perf_counter()
                            f(x)
                            samples[way][m].append(time.perf_counter() - t0)
        report["us"][name] = {way: {m: round(statistics.median(s) * 1e6, 1) for m, s in v.items()}
                              for way, v in samples.items()}
        report["p10_us"][name] = {way: {m: round(statistics.quantiles(s, n=10)[0] * 1e6, 1) for m, s in v.items()}
                                  for way, v in samples.items()}
        print(name, json.dumps(report["us"][name]), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
