"""Prompt prefill time: viasd's static-cache pass in each weight format vs transformers' own forward.

    python benchmarks/suites/prefill.py --tokens 768 --formats none,int8,int4,int4-operators --threads 2

One prompt of random token ids through `FastModel.forward` (one pass, run layer by layer over
chunks of 256; the last position's logits), and transformers' forward of the same ids in one call
(`logits_to_keep=1`, fp32) as the baseline. Every path runs once per round, `--repeats` rounds after
one warm-up, interleaved (the machine's drift falls on all alike); the median of each is reported.
Two reference paths: `FMT-chunks` feeds the prompt as separate passes of 256 positions (each chunk
through every layer in turn: an int8/int4 layer widened once a chunk, the path before layer-major
prefill), `int4-kernel` runs tinygemm's kernel for every row (no widened weight at all), and
`int4-operators` widens each layer with PyTorch's operators instead of viasd_kernels' one-pass
kernel (kernels/cpu_int4_widen.py). `none-packed`
runs float32's chunks through oneDNN's packed product (runtime/short_products.py).
Prints one JSON object (docs/performance.md's prefill tables).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from viasd_kernels import cpu_int4_widen

from viasd_core.runtime import packed_cpu
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.model_pass import PREFILL_CHUNK
from viasd_core.runtime.short_products import ShortRows
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import packed_copy
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def prefill_path(fast: FastModel, ids: torch.Tensor, name: str):
    """The prefill that path `name` runs on `fast` (see the module doc)."""
    kernel_only = name.endswith("-kernel")
    operators = name.endswith("-operators")

    def prefill():
        fast.reset()
        dense, widen = packed_cpu._int4_dense_cpu, cpu_int4_widen.widen
        if kernel_only:
            packed_cpu._int4_dense_cpu = lambda *a: None
        if operators:
            cpu_int4_widen.widen = lambda *a, **kw: None
        try:
            if name.endswith("-chunks"):
                for c in range(0, ids.shape[0], PREFILL_CHUNK):
                    fast.forward(ids[c : c + PREFILL_CHUNK], c, 1)
            else:
                fast.forward(ids, 0, 1)
        finally:
            packed_cpu._int4_dense_cpu, cpu_int4_widen.widen = dense, widen

    return prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--formats", default="none,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.model, dtype="float32")
    ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    out = {"device": device_name(torch.device("cpu")), "threads": args.threads, "tokens": args.tokens,
           "repeats": args.repeats}
    paths = {"transformers fp32": lambda: target.model(ids[None], logits_to_keep=1)}
    for name in args.formats.split(","):
        fmt = name.removesuffix("-kernel").removesuffix("-chunks").removesuffix("-packed").removesuffix("-operators")
        model = target.model if fmt == "none" else packed_copy(target.model, WeightFormat.parse(fmt))
        fast = FastModel(model, max_len=args.tokens + 32)
        if name.endswith("-packed"):  # float32 chunks through oneDNN's packed product (short_products.py)
            fast.short_rows = ShortRows(fast.short_rows.blocked, fast.short_rows.packed, prefill=True)
        paths[f"viasd {name}"] = prefill_path(fast, ids, name)
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for fn in paths.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    out["ms"] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    base = out["ms"]["transformers fp32"]
    out["x_transformers"] = {k: round(base / v, 2) for k, v in out["ms"].items()}
    out["tokens_per_s"] = {k: round(args.tokens / v * 1e3) for k, v in out["ms"].items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
