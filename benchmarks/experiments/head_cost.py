"""What one drafted token costs: an EAGLE-3 head step vs a target pass, on this machine.

    python benchmarks/experiments/head_cost.py [--draft embedded:smollm2-135m-eagle3] [--steps 100] [--threads 2]

Loads the session's target and head (the embedded pair by default), prefills a 64-token prompt,
then times `steps` one-token target passes and `steps` one-token head steps (the head's own
feature fed back, as when drafting), in 3 alternating rounds; prints the medians, their ratio and
the head's parameter count (the shared embedding excluded) as JSON. Eager, batch 1, the session's dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from viasd_core.session import build_session
from viasd_core.loading.options import ModelOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="embedded:smollm2-135m-eagle3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    session = build_session(ModelOptions(model=args.model, draft=args.draft, max_context=1024, compile="off"), mode="sd")
    drafter = session.engine.drafter
    head, target = drafter.head, session.engine.target
    ids = torch.randint(100, 20000, (64 + 3 * args.steps + 8,), generator=torch.Generator().manual_seed(0))
    target.forward(ids[:64], 0, 1)
    _, hidden = head.forward(ids[1:64], target.cache.features[:63], 0, n_logits=1)
    h = hidden[-1:]
    target_ms, head_ms = [], []
    pos_t, pos_h = 64, 63
    with torch.inference_mode():
        for _ in range(3):
            for _ in range(args.steps):
                t = time.perf_counter()
                target.forward(ids[pos_t : pos_t + 1], pos_t, 1)
                target_ms.append((time.perf_counter() - t) * 1000)
                pos_t += 1
            for _ in range(args.steps):
                t = time.perf_counter()
                _, h = head.forward(ids[pos_h + 1 : pos_h + 2], h, pos_h, n_logits=1)
                head_ms.append((time.perf_counter() - t) * 1000)
                pos_h += 1
    params = sum(p.numel() for p in head.parameters())
    t_ms, h_ms = statistics.median(target_ms), statistics.median(head_ms)
    print(json.dumps({"draft": args.draft, "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
                      "threads": torch.get_num_threads(), "target_ms": round(t_ms, 3), "head_ms": round(h_ms, 3),
                      "ratio": round(h_ms / t_ms, 4), "head_params": params, "steps": len(head_ms)}, indent=1))


if __name__ == "__main__":
    main()
