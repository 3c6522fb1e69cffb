"""What one pass of a model costs on this device, measured: the one timing loop behind every choice
made from measured costs (the threshold fit, `--tree auto`, `--threads auto`, `--quant auto`)."""

from __future__ import annotations

import statistics
import time

import torch

from viasd_core.runtime.model import FastModel


@torch.inference_mode()
def time_passes(model: FastModel, widths=(1,), context: int = 128, repeats: int = 5) -> dict[int, float]:
    """Median seconds of `model`'s pass over w tokens after `context` cached positions, for each
    width w in `widths`. Each pass returns every row's logits (the verify shape, so a compiled model
    is timed on its own graphs). `context` shrinks where the cache holds fewer positions
    (--max-context is never exceeded). The cache is empty afterwards."""
    device = model.device
    widest = max(widths)
    context = max(1, min(context, model.max_len - widest - 1))
    model.allocate(context + widest + 1)
    ids = torch.randint(10, min(1000, model.shape.vocab_size), (context + widest,), device=device)
    model.reset()
    model.forward(ids[:context], 0, 1)
    seconds = {}
    for w in widths:
        times = []
        for _ in range(repeats):
            model.rollback(context)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            model.forward(ids[context : context + w], context, w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        seconds[w] = statistics.median(times)
    model.reset()
    return seconds


def call_seconds(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` (a host function that waits for its own result),
    after one untimed warm-up call: the benchmarks' timing of whole operations."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times

