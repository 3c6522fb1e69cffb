"""Short float32 passes on a CPU: the blocked and packed products (runtime/short_products.py) against F.linear.

    python benchmarks/experiments/short_passes.py --threads 2 --widths 1,4,6,16

First the raw products: products of each width over 90 distinct 1536x576 float32 weights (they
stream from memory, as a model's do), as F.linear, as the blocked product and as the packed one,
beside a plain sum over 540 MB (what the memory gives). Then the target's passes over w tokens after
256 cached positions (`pass_timing.time_passes`), with every product through F.linear, through the
blocked product and through the packed one: the best of `--rounds` interleaved rounds of
`--repeats` passes.
Prints one JSON object (docs/experiments/fp32-short-passes-blocked.md).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from viasd_core.runtime import short_products
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_timing import call_seconds, time_passes
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def best_seconds(fn, repeats: int = 7) -> float:
    return min(call_seconds(fn, repeats))


def raw_products(widths: tuple[int, ...]) -> dict:
    layers = []
    for _ in range(90):
        layer = torch.nn.Linear(576, 1536, bias=False)
        layer.weight.data = torch.randn(1536, 576)
        layers.append(layer)
    size = sum(layer.weight.numel() * 4 for layer in layers)
    big = torch.randn(540 * 2**20 // 4)
    out = {}
    with torch.no_grad():
        for rows in widths:
            x = torch.randn(rows, 576)
            takes = short_products.takes_of(layers[0])  # the layers are alike
            out[rows] = {way: round(size / best_seconds(lambda: [short_products.eager_linear(x, layer, up_to, takes)
                                                                 for layer in layers]) / 1e9, 1)
                         for way, up_to in short_products.WAYS.items() if way != "packed" or short_products.packs(layers[0])}
        out["sum"] = round(big.numel() * 4 / best_seconds(lambda: big.sum()) / 1e9, 1)
    return out  # GB/s of weights read


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
    ways = {w: r for w, r in short_products.WAYS.items() if w != "packed" or short_products.packs(model.lm_head)}
    best = {way: {} for way in ways}
    for _ in range(args.rounds):
        for way, rows in ways.items():
            model.short_rows = rows
            for w, s in time_passes(model, widths, context=256, repeats=args.repeats).items():
                best[way][w] = min(s, best[way].get(w, float("inf")))
    print(json.dumps({
        "device": device_name(torch.device("cpu")), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads, "torch": torch.__version__, "model": args.model,
        "raw_GBps": raw_products(widths),
        "pass_ms": {way: {w: round(s * 1e3, 1) for w, s in best[way].items()} for way in best},
    }))


if __name__ == "__main__":
    main()
