"""What the norm kernel saves a drafting step of the EAGLE-3 head, in one process.

    python benchmarks/experiments/head_norms.py --threads 2 --rounds 8

The default session (`--quant auto`), the head prefilled over 300 positions of random tokens and
features, then 1-token steps from its own feature (as when drafting) at position 300, two ways in
turn each round: "norm kernel" (the head's eager calls as `allocate` binds them, head_calls.py) and
"modules" (the same calls with transformers' RMSNorm forward for the four norms). Each keeps its best round of 200 steps; prints one JSON
object in microseconds a step (docs/experiments/int4-scales-blockwise-prefetch.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from viasd_core.devices import device_name
from viasd_core.loading.options import ModelOptions
from viasd_core.session import build_session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    session = build_session(ModelOptions(threads=args.threads, tree="off", max_context=1024), mode="sd")
    drafter = session.engine.drafter
    head = getattr(drafter, "model_drafter", drafter).head  # the default pair: the head beside prompt lookup
    H = head.hidden_size
    ids = torch.randint(10, 1000, (301,), generator=torch.Generator().manual_seed(0))
    feats = torch.randn(300, 3 * H, generator=torch.Generator().manual_seed(1)).to(head.dtype)
    head.forward(ids[:300], feats, 0)
    own = torch.randn(1, H, generator=torch.Generator().manual_seed(2)).to(head.dtype)
    kernel_calls = head.eager_calls
    norms = ("input_norm", "hidden_norm", "post_norm", "final_norm")
    module_calls = dataclasses.replace(kernel_calls, **{n: getattr(head.traced_calls, n) for n in norms})

    def steps(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            head.rollback(300)
            head.forward(ids[300:301], own, 300)
        return (time.perf_counter() - t) / n * 1e6

    best = {"norm kernel": float("inf"), "modules": float("inf")}
    try:
        for _ in range(args.rounds):
            for name in best:
                head.__dict__["eager_calls"] = kernel_calls if name == "norm kernel" else module_calls
                steps(20)
                best[name] = min(best[name], steps(200))
    finally:
        head.__dict__["eager_calls"] = kernel_calls
    print(json.dumps({"device": device_name(session.engine.device), "threads": torch.get_num_threads(),
                      "quant": session.options.quant, "draft": session.draft_id,
                      "us_per_step": {k: round(v, 1) for k, v in best.items()}}, indent=1))


if __name__ == "__main__":
    main()
