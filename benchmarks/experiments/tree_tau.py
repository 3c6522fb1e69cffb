"""Tokens per target pass (tau) of `sd` with chains and with token trees, on the 26-prompt dev set.

Fixed shapes only (no adaptive policy, no timing): tau then depends on the models and prompts, not
on the machine or its load, so this can run beside other jobs. Greedy, 128 new tokens, eager.

    python benchmarks/experiments/tree_tau.py none docs/results/cpu-tree-tau-fp32.json   # --quant none (fp32)
"""

from __future__ import annotations

import json
import sys

from viasd_core.speculation.engine import GenerationConfig
from viasd_core.speculation.tree import TreeShape
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.prompts import encode, load_prompts
from viasd_core.session import build_session

RUNS = {"sd fixed chain 5": dict(adaptive=False, gamma=5)}
for shape in [(2, 4, 5), (3, 5, 10), (4, 6, 15)]:  # (top-k, depth, nodes)
    RUNS[f"tree {shape}"] = dict(adaptive=False, tree=TreeShape(*shape))


def main(quant: str, out: str) -> None:
    session = build_session(ModelOptions(quant=quant, compile="off", tree="off"), mode="sd")
    engine = session.engine
    prompts = load_prompts("docs/results/cpu-prompts.jsonl")
    result = {}
    for name, kwargs in RUNS.items():
        tokens = passes = 0
        per_category: dict[str, list[int]] = {}
        for p in prompts:
            engine.reset()
            g = engine.generate(encode(session.tokenizer, p.text), GenerationConfig(mode="sd", max_new_tokens=128, **kwargs))
            tokens += len(g.tokens)
            passes += g.stats.target_passes
            c = per_category.setdefault(p.category, [0, 0])
            c[0] += len(g.tokens)
            c[1] += g.stats.target_passes
        result[name] = {"tau": tokens / passes, "tokens": tokens, "target_passes": passes,
                        "by_category": {k: v[0] / v[1] for k, v in per_category.items()}}
        print(name, round(tokens / passes, 3), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
