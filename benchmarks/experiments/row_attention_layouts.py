"""The row-attention kernel's own code against its plain code, per call (the AVX2 class's layout).

    python benchmarks/experiments/row_attention_layouts.py [--rounds 7] [--reps 50]

SmolLM2-135M's attention shape (9 query heads over 3 KV heads of 64, bfloat16 cache of 1024 slots),
1 and 6 rows after 32, 300 and 700 keys, on 1 and 2 threads: `row_attention` as the engine calls it
and with `plain=True` (the plain code alone: on a build that is not the AVX2 class's the two are the
same code). Each setting keeps its best of `--rounds` rounds of `--reps` calls (Python's call
included: ~10 us). Prints one JSON object (docs/experiments/avx2-row-attention-layout.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from viasd_core.devices import device_name
from viasd_core.runtime import cpu_kernels
from viasd_kernels import cpu_row_attention as ra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    folder = cpu_kernels.folder()
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 3, 1024, 64, generator=g).bfloat16() for _ in range(2))
    qs = {T: torch.randn(1, 9, T, 64, generator=g).bfloat16() for T in (1, 6)}
    out = {"device": device_name(torch.device("cpu")), "lanes": ra.lanes(folder), "us": {}}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for plain in (True, False):
            for end in (32, 300, 700):
                for T, q in qs.items():
                    best = float("inf")
                    for _ in range(args.rounds):
                        t0 = time.perf_counter()
                        for _ in range(args.reps):
                            ra.row_attention(q, k, v, end, build_dir=folder, plain=plain)
                        best = min(best, (time.perf_counter() - t0) / args.reps)
                    key = f"{'plain' if plain else 'kernel'} threads={threads} keys={end} rows={T}"
                    out["us"][key] = round(best * 1e6, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
