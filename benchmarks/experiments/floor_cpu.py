"""The bandwidth floor of plain decoding and our `ar` as a fraction of it (issue: speed).

floor (s/token) = bytes of weights read per target pass / measured read bandwidth.
Read bandwidth: median time of `x.sum()` over a buffer larger than the last-level cache.

    python benchmarks/experiments/floor_cpu.py [--model smollm2-135m] [--gb 2]
"""

import argparse
import json
import statistics
import time

import torch

from viasd_core.loading.models import load_model
from viasd_core.runtime.model import FastModel


def read_bandwidth(gb: float, repeats: int = 7) -> float:
    x = torch.ones(int(gb * 1e9 / 4))
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def weight_bytes(model) -> int:
    # Every parameter is read once per pass (tied embedding/lm_head counted once: the lm_head read).
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    return total - emb.numel() * emb.element_size() * (0 if emb.data_ptr() == model.get_output_embeddings().weight.data_ptr() else 1)


def ar_seconds_per_token(model, context: int = 256, steps: int = 60) -> float:
    fast = FastModel(model, max_len=context + steps + 1)
    ids = torch.randint(10, 1000, (context + steps,))
    fast.forward(ids[:context], 0, 1)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        fast.forward(ids[context + i : context + i + 1], context + i, 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gb", type=float, default=2.0)
    args = ap.parse_args()
    model = load_model(args.model, device="cpu", with_tokenizer=False).model
    bw = read_bandwidth(args.gb)
    nbytes = weight_bytes(model)
    floor = nbytes / bw
    per_token = ar_seconds_per_token(model)
    print(json.dumps({
        "model": args.model, "threads": torch.get_num_threads(), "weight_bytes_per_pass": nbytes,
        "read_bandwidth_GBps": bw / 1e9, "floor_ms_per_token": floor * 1e3, "floor_tokens_per_s": 1 / floor,
        "ar_ms_per_token": per_token * 1e3, "ar_tokens_per_s": 1 / per_token, "fraction_of_floor": floor / per_token,
    }, indent=2))


if __name__ == "__main__":
    main()
