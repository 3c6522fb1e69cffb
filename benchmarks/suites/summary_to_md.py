"""Markdown tables from `viasd bench` summary.json files (for docs/benchmarks.md).

    python benchmarks/suites/summary_to_md.py out/cpu/bench-default/summary.json [...]
"""

import json
import sys


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table(path: str) -> str:
    s = json.load(open(path))
    meta = s["meta"]
    lines = [
        f"`{path}`: {meta.get('label')} on {meta.get('device_name', meta.get('device'))}, "
        f"target {meta.get('target', {}).get('id')}, draft {meta.get('draft', {}).get('id')}, "
        f"{meta.get('n_prompts', meta.get('prompts', {}).get('count') if isinstance(meta.get('prompts'), dict) else meta.get('prompts'))} prompts, "
        f"date {meta.get('date')}, torch {meta.get('versions', {}).get('torch', meta.get('torch'))}, "
        f"transformers {meta.get('versions', {}).get('transformers', meta.get('transformers'))}",
        f"command: `{' '.join(meta['command']) if isinstance(meta.get('command'), list) else meta.get('command')}`",
        "",
        "| method | status | tokens/s (mean ± std over prompts) | speedup vs ar | vs hf | tokens / target pass | acceptance | tiers accept/slim/full/bonus | fidelity mean (min) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in s["methods"].items():
        if m["status"] != "ok":
            lines.append(f"| {name} | {m['status']}: {m.get('reason')} | | | | | | | |")
            continue
        sh = m.get("tier_shares")
        tiers = "/".join(f"{sh.get(k, 0):.2f}" for k in ("accept", "slim", "full", "bonus")) if sh else "-"
        lines.append(
            f"| {name} | ok | {fmt(m['tokens_per_s_mean'], '.1f')} ± {fmt(m['tokens_per_s_std'], '.1f')} | "
            f"{fmt(m['speedup_vs_ar'])}x | {fmt(m['speedup_vs_hf'])}x | {fmt(m['mean_accepted_length'])} | "
            f"{fmt(m['acceptance_rate'])} | {tiers} | {fmt(m['fidelity_mean'], '.4f')} ({fmt(m['fidelity_min'], '.3f')}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
