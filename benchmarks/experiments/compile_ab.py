"""Compiled against eager `ar` on this CPU, in one process: does `--compile auto`'s probe predict it?

    python benchmarks/experiments/compile_ab.py --threads 2 --max-context 1024 -n 64 > out.json

One session with `--compile on` (float32, the embedded target), the 26 held-out prompts of
docs/results/cpu-prompts.jsonl, greedy `ar`. Each prompt runs compiled, then with the target's
passes eager (the same model, its graphs kept: FastModel.eager), so drift on a shared machine falls
on both alike. Reports decode milliseconds per token (time after the first token over the tokens
after it: prefill runs eager either way) and the probe's own timing (machine/compile.py: time_compiled)
taken in the same process (docs/experiments/startup-compile-first-block.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from viasd_core.machine.compile import time_compiled
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.devices import device_name
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.prompts import encode, load_prompts
from viasd_core.session import build_session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default="docs/results/cpu-prompts.jsonl")
    args = ap.parse_args()
    session = build_session(ModelOptions(threads=args.threads, quant="none", compile="on", max_context=args.max_context),
                            mode="ar")
    engine = session.engine
    config = GenerationConfig(mode="ar", max_new_tokens=args.max_new_tokens)
    prompts = [encode(session.tokenizer, p.text) for p in load_prompts(args.prompts)]
    probe = time_compiled(engine.target)
    per_token = {"compiled": [], "eager": []}

    def run(ids):
        engine.reset()
        t = time.perf_counter()
        out = engine.generate(ids, config)
        wall = time.perf_counter() - t
        return (wall - out.stats.time_first_token) / max(len(out.tokens) - 1, 1)

    for ids in prompts[:1]:  # warm-up, both ways
        run(ids)
        with engine.target.eager():
            run(ids)
    for ids in prompts:
        per_token["compiled"].append(run(ids))
        with engine.target.eager():
            per_token["eager"].append(run(ids))
    ms = {k: 1e3 * statistics.mean(v) for k, v in per_token.items()}
    print(json.dumps({
        "device": device_name(engine.device), "threads": torch.get_num_threads(), "max_context": args.max_context,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "compile_seconds": session.compile_seconds,
        "probe_ms": {k: round(v * 1e3, 1) for k, v in probe.items()},
        "decode_ms_per_token": {k: round(v, 2) for k, v in ms.items()},
        "eager_over_compiled": round(ms["eager"] / ms["compiled"], 3),
        "compiled_faster_on": sum(c < e for c, e in zip(per_token["compiled"], per_token["eager"])),
    }, indent=1))


if __name__ == "__main__":
    main()
