"""Short float32 passes on a CPU: the blocked product (decoding/short_products.py) against F.linear.

    python benchmarks/short_passes.py --threads 2 --widths 1,4,6,16

First the raw products: a 1-row product over 90 distinct 1536x576 float32 weights (they stream from
memory, as a model's do), as F.linear and as the blocked product, beside a plain sum over 540 MB
(what the memory gives). Then the target's passes over w tokens after 256 cached positions
(`pass_timing.time_passes`), with every product through F.linear (`short_rows` 0) and through the
blocked product (`short_rows` 16): the best of `--rounds` interleaved rounds of `--repeats` passes.
Prints one JSON object (docs/benchmarks.md section 17).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from viasd_core.decoding import short_products
from viasd_core.decoding.model import FastModel
from viasd_core.decoding.pass_timing import call_seconds, time_passes
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def best_seconds(fn, repeats: int = 7) -> float:
    return min(call_seconds(fn, repeats))


def raw_products() -> dict:
    weights = [torch.randn(1536, 576) for _ in range(90)]
    layers = []
    for w in weights:
        layer = torch.nn.Linear(576, 1536, bias=False)
        layer.weight.data = w
        layers.append(layer)
    x = torch.randn(1, 576)
    size = sum(w.numel() * 4 for w in weights)
    big = torch.randn(540 * 2**20 // 4)
    with torch.no_grad():
        plain = best_seconds(lambda: [F.linear(x, w) for w in weights])
        blocked = best_seconds(lambda: [short_products.linear(x, layer) for layer in layers])
        total = best_seconds(lambda: big.sum())
    return {"F.linear_GBps": round(size / plain / 1e9, 1), "blocked_GBps": round(size / blocked / 1e9, 1),
            "sum_GBps": round(big.numel() * 4 / total / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--widths", default="1,4,6,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    model = FastModel(load_model(args.model, device="cpu", quant="none", with_tokenizer=False).model, max_len=512)
    best = {0: {}, short_products.SHORT_ROWS: {}}
    for _ in range(args.rounds):
        for rows in best:
            model.short_rows = rows
            for w, s in time_passes(model, widths, context=256, repeats=args.repeats).items():
                best[rows][w] = min(s, best[rows].get(w, float("inf")))
    print(json.dumps({
        "device": device_name(torch.device("cpu")), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads, "torch": torch.__version__, "model": args.model,
        "raw_1_row": raw_products(),
        "pass_ms": {"F.linear": {w: round(s * 1e3, 1) for w, s in best[0].items()},
                    "blocked": {w: round(s * 1e3, 1) for w, s in best[short_products.SHORT_ROWS].items()}},
    }))


if __name__ == "__main__":
    main()
