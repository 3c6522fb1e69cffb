"""Where a decoding pass's time goes: matrix products vs everything else, eager vs compiled.

    python benchmarks/experiments/profile_step.py [--max-context 1024] [--steps 20] [--threads 2]

Runs the embedded SmolLM2-135M target's 1-token step and a 6-token verify pass (padded to 8 when
compiled) after a 200-token prefill, under torch.profiler, and prints per pass: wall time, the
time in matrix products (aten::mm / addmm / bmm / linear's kernels) and the rest. The compiled
model is warmed up (all graphs compiled) before anything is timed. One JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from viasd_core.loading.models import load_model
from viasd_core.runtime.model import FastModel

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_mkl_linear", "mkldnn::_linear_pointwise",
              "aten::_weight_int8pack_mm"}


def measure(model: FastModel, ids: torch.Tensor, width: int, steps: int) -> dict:
    def one_pass(i: int) -> None:
        pos = 200 + i
        model.rollback(pos)
        model.forward(ids[pos : pos + width], pos, width)

    model.reset()
    model.forward(ids[:200], 0, 1)
    for i in range(3):
        one_pass(i)
    t0 = time.perf_counter()
    for i in range(steps):
        one_pass(i)
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            one_pass(i)
    matmul_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS)
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages())
    return {"width": width, "wall_ms": wall * 1e3, "matmul_ms": matmul_us / steps / 1e3,
            "other_ms": (total_us - matmul_us) / steps / 1e3, "profiled_ms": total_us / steps / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf = load_model("smollm2-135m").model
    ids = torch.randint(100, 40000, (400,), generator=torch.Generator().manual_seed(0))
    for compiled in (False, True):
        model = FastModel(hf, max_len=args.max_context)
        compile_s = None
        if compiled:
            model.compile(None)
            compile_s = model.warm_up(8)
        for width in (1, 6):
            row = measure(model, ids, width, args.steps)
            print(json.dumps({"compiled": compiled, "compile_s": compile_s, "max_context": args.max_context,
                              "threads": args.threads, **row}), flush=True)


if __name__ == "__main__":
    main()
