"""The exactness table: for bench runs of `ar` beside speculative modes, how many prompts each mode
emitted `ar`'s tokens on, and where the first divergence fell.

Each run folder is one `viasd bench --methods ar,sd[,exact] --out DIR` (one weight format, one
instruction-set class); its name says which (`CLASS-FORMAT`, as benchmarks/exactness.sh writes
them). Greedy runs only: sampled tokens are compared by distribution, not here.

    python benchmarks/exactness_table.py out/exactness/*/ [--json docs/results/exactness-....json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def compare(folder: Path) -> dict:
    """{mode: {"prompts", "identical", "first_divergence": [(prompt_id, index), ...]}} for one run."""
    runs: dict[str, dict[str, list[int]]] = defaultdict(dict)
    with open(folder / "results.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("status") == "ok" and row.get("repeat", 0) == 0 and row.get("tokens") is not None:
                runs[row["method"]][str(row["prompt_id"])] = row["tokens"]
    if "ar" not in runs:
        raise SystemExit(f"{folder}: no ar run to compare with")
    ar = runs.pop("ar")
    out = {}
    for mode, by_prompt in sorted(runs.items()):
        diverged = []
        for pid, toks in by_prompt.items():
            want = ar.get(pid)
            if want is None:
                continue
            if toks != want:
                at = next((i for i, (a, b) in enumerate(zip(toks, want)) if a != b), min(len(toks), len(want)))
                diverged.append((pid, at))
        shared = sum(1 for pid in by_prompt if pid in ar)
        out[mode] = {"prompts": shared, "identical": shared - len(diverged), "first_divergence": diverged}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    table = {}
    for folder in args.folders:
        if (folder / "results.jsonl").exists():
            table[folder.name] = compare(folder)
    print("| run | mode | prompts identical to ar | first divergences (prompt: token) |")
    print("| --- | --- | --- | --- |")
    for name, modes in table.items():
        for mode, r in modes.items():
            where = ", ".join(f"{p}: {i}" for p, i in r["first_divergence"]) or "-"
            print(f"| {name} | {mode} | {r['identical']} / {r['prompts']} | {where} |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
