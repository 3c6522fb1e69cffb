"""How much faster an int8 product could make a prefill's products, per instruction-set class.

    VIASD_MAX_CPU_ISA=avx512 python benchmarks/experiments/int8_gemm_headroom.py --threads 2

One prefill chunk's product shape (256 rows x 576 inputs x 1536 outputs: SmolLM2's gate/up half)
through PyTorch's CPU kernels: `torch._int_mm` (int8 x int8 -> int32, oneDNN), the same split into the
int4 weights' groups of 64 inputs (one product a group, as group-wise scales would need), float32
`torch.mm` (MKL: what the float32 prefill and transformers run) and bfloat16 `torch.mm` (oneDNN; AMX
where the CPU has it and no cap hides it). The median of `--repeats` calls after a warm-up, in ms.
Only the products: quantizing the rows and applying the scales are not counted
(docs/experiments/xeon-classes-20261202.md).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import viasd_core  # noqa: F401 (applies VIASD_MAX_CPU_ISA to PyTorch's kernels before the first call)
from viasd_core.devices import device_name
from viasd_core.runtime.pass_timing import call_seconds


def ms(fn, repeats: int) -> float:
    return statistics.median(call_seconds(fn, repeats)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--inputs", type=int, default=576)
    ap.add_argument("--outputs", type=int, default=1536)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    m, k, n = args.rows, args.inputs, args.outputs
    a8 = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b8 = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8)
    a32, b32 = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    groups = [(a8[:, i : i + args.group].contiguous(), b8[i : i + args.group].contiguous())
              for i in range(0, k, args.group)]
    out = {"device": device_name(torch.device("cpu")), "shape": [m, k, n], "group": args.group,
           "threads": args.threads, "ms": {
               "int8 _int_mm": ms(lambda: torch._int_mm(a8, b8), args.repeats),
               f"int8 _int_mm by groups of {args.group}": ms(lambda: [torch._int_mm(x, y) for x, y in groups],
                                                             args.repeats),
               "float32 mm": ms(lambda: torch.mm(a32, b32), args.repeats),
               "bfloat16 mm": ms(lambda: torch.mm(a16, b16), args.repeats)}}
    base = out["ms"]["float32 mm"]
    out["x_float32"] = {name: round(base / v, 2) for name, v in out["ms"].items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
