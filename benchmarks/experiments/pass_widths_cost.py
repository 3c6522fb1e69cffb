"""What a short pass of w positions costs against a 1-position pass, in one weight format, on this CPU.

    python benchmarks/experiments/pass_widths_cost.py --format int4 --threads 2
    VIASD_MAX_CPU_ISA=avx2 python benchmarks/experiments/pass_widths_cost.py --format int4

The embedded target's FastModel after 300 cached positions, its int products in the way the machine
chose (machine/packed_way.py; `VIASD_PACKED_WAY` pins one, as for an A/B); for each width, `--passes` passes of w
new positions (each over the same cached prefix), the best of `--rounds` interleaved rounds. A verify
pass of gamma + 1 positions pays off only while its cost stays near a 1-position pass's: tau / cost
is sd's ceiling over ar (docs/experiments/xeon-classes-20261202.md). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from viasd_core.devices import device_name
from viasd_core.loading.models import load_model
from viasd_core.machine import packed_way
from viasd_core.runtime import cpu_kernels
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import packed_copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int4")
    ap.add_argument("--widths", default="1,2,3,4,6,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    target = load_model("smollm2-135m", dtype="float32")
    cpu_kernels.use_packed_way(packed_way.portable())  # as the loader hands it over for an int format
    model = target.model if args.format == "none" else packed_copy(target.model, WeightFormat.parse(args.format))
    fast = FastModel(model, max_len=300 + max(widths) + 32)
    ids = torch.randint(100, 40000, (300 + max(widths),), generator=torch.Generator().manual_seed(0))
    best: dict[int, float] = {}
    with torch.inference_mode():
        fast.reset()
        fast.forward(ids[:300], 0, 1)
        for _ in range(args.rounds):
            for w in widths:
                t = time.perf_counter()
                for _ in range(args.passes):
                    fast.forward(ids[300 : 300 + w], 300, w)
                ms = (time.perf_counter() - t) / args.passes * 1e3
                best[w] = min(best.get(w, ms), ms)
    one = best[widths[0]]
    print(json.dumps({"device": device_name(torch.device("cpu")), "format": args.format, "threads": args.threads,
                      "packed_way": cpu_kernels.packed_mm_way(),
                      "ms": {str(w): round(v, 3) for w, v in best.items()},
                      "x_first": {str(w): round(v / one, 2) for w, v in best.items()}}, indent=2))


if __name__ == "__main__":
    main()
