"""Float32 passes on a CPU compiled with the weights frozen into the graphs (inductor's C++ GEMM).

    python benchmarks/experiments/frozen_compile.py --threads 2 --widths 1,2,4,8,16 [--dynamic] > out.json

An experiment, not a path viasd takes. `--compile` compiles the target's pass with the weights as
graph inputs, so inductor calls PyTorch's own matrix products (docs/experiments/startup-compile-first-block.md).
With `freezing` the weights become constants of each graph, and with the C++ backend of
max-autotune inductor writes its own small-row GEMM over a prepacked copy of them. This script
times the embedded target's passes eagerly (as viasd runs them on a CPU: `short_rows` 1) and
compiled that way (every width's graph compiled first, then timed), and reports the compile time
and the process's resident memory before and after (each graph appears to hold its own packed weights).
`--dynamic` compiles the pass with a dynamic row count instead of one graph per padded width
(dynamo still gives a 1-token pass a graph of its own), and reports how many graphs it compiled.
Prints one JSON object (docs/experiments/avx2-cpu-bf16-products.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_timing import time_passes
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def resident_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dynamic", action="store_true", help="one graph for every width (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    model = FastModel(load_model(args.model, device="cpu", quant="none", with_tokenizer=False).model, max_len=512)
    loaded = resident_gib()
    eager = time_passes(model, widths, context=256, repeats=args.repeats)
    inductor_config.freezing = True
    inductor_config.max_autotune_gemm_backends = "CPP"
    start = time.perf_counter()
    before = counters["stats"]["unique_graphs"]
    model.compile("max-autotune-no-cudagraphs", dynamic=args.dynamic)
    time_passes(model, widths, context=256, repeats=1)  # compiles every graph the widths need
    compile_s = time.perf_counter() - start
    compiled = time_passes(model, widths, context=256, repeats=args.repeats)
    print(json.dumps({
        "device": device_name(torch.device("cpu")), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads, "torch": torch.__version__, "model": args.model,
        "dynamic": args.dynamic, "graphs": counters["stats"]["unique_graphs"] - before,
        "compile_s": round(compile_s, 1), "resident_gib": {"loaded": round(loaded, 2), "compiled": round(resident_gib(), 2)},
        "pass_ms": {"eager": {w: round(s * 1e3, 1) for w, s in eager.items()},
                    "frozen_compiled": {w: round(s * 1e3, 1) for w, s in compiled.items()}},
    }))


if __name__ == "__main__":
    main()
