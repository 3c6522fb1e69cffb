"""What the one-call RMSNorm and RoPE-with-cache-writes kernels save a CPU pass.

    python benchmarks/experiments/glue_kernels.py --threads 2 --rounds 6 [--quant int4]

The embedded target (SmolLM2-135M), passes of w tokens after 300 cached positions, in one process
with each setting in turn every round (this machine's speed drifts by several percent between
processes): "both kernels" (what the engine runs), "no norm kernel" (transformers' RMSNorm
modules), "no rope kernel" (apply_rope and LayerCache.update) and "neither". Each setting keeps its
best round. Prints one JSON object (docs/experiments/per-layer-operators-one-call.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from viasd_core.runtime.model import FastModel
from viasd_core.devices import device_name
from viasd_core.loading.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,6")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    model = FastModel(load_model("embedded", quant=args.quant, with_tokenizer=False).model, max_len=1024, name="target")
    ids = torch.randint(10, 1000, (300 + max(widths),), generator=torch.Generator().manual_seed(0))
    model.allocate(300 + max(widths) + 1)
    model.reset()
    model.forward(ids[:300], 0, 1)
    kernel_norms = ([(c.input_norm, c.post_norm) for c in model._calls], model._final_norm)
    module_norms = ([(layer.input_layernorm.forward, layer.post_attention_layernorm.forward) for layer in model.layers],
                    model.norm.forward)

    def use(norm_kernel: bool, rope_kernel: bool) -> None:
        per_layer, final = kernel_norms if norm_kernel else module_norms
        model._calls = [c.__class__(**{**{f: getattr(c, f) for f in c.__slots__}, "input_norm": a, "post_norm": b})
                        for c, (a, b) in zip(model._calls, per_layer)]
        model._final_norm = final
        model.bind_kernels(rope_kernel=rope_kernel)

    settings = {"both kernels": (True, True), "no norm kernel": (False, True), "no rope kernel": (True, False),
                "neither": (False, False)}
    best = {name: {w: float("inf") for w in widths} for name in settings}
    try:
        for _ in range(args.rounds):
            for name, (norm_kernel, rope_kernel) in settings.items():
                use(norm_kernel, rope_kernel)
                for w in widths:
                    t = time.perf_counter()
                    for _ in range(20):
                        model.rollback(300)
                        model.forward(ids[300 : 300 + w], 300, w)
                    best[name][w] = min(best[name][w], (time.perf_counter() - t) / 20)
    finally:
        use(True, True)
    print(json.dumps({"device": device_name(model.device), "threads": args.threads, "quant": args.quant,
                      "context": 300, "ms": {n: {w: round(s * 1e3, 2) for w, s in v.items()} for n, v in best.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
