"""The exactness table: does greedy `sd` (chains and token trees) emit `ar`'s tokens, prompt by prompt,
in each weight format and instruction-set class?

Each (class, format) runs in its own process started with VIASD_MAX_CPU_ISA set (the cap must be in
place before PyTorch dispatches anything), loads the session as `viasd generate` does, decodes every
prompt with `ar`, with `sd` over the pair's default draft (chains) and with `sd` over token trees,
and writes OUT/CLASS-FORMAT.json; a finished run is skipped, so the script resumes. Then it prints the
table: prompts identical to `ar` and, where not, the first token that differs.

    python benchmarks/suites/exactness.py --out out/exactness --classes native,avx512,avx2 \\
        --formats none,int8,int4,8bit,4bit -n 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = (3, 4, 10)  # topk, depth, size: a tree of 10 nodes


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_one(fmt: str, prompts_path: Path, new_tokens: int, threads: str, out: Path) -> None:
    """In a process whose cap is already set: every prompt in ar, sd and sd over trees."""
    from viasd_core.speculation.engine import GenerationConfig
    from viasd_core.speculation.exactness import promise
    from viasd_core.speculation.tree import TreeShape
    from viasd_core.loading.options import ModelOptions
    from viasd_core.loading.prompts import encode, load_prompts
    from viasd_core.session import build_session
    from viasd_core import cpu_isa

    opts = ModelOptions(quant=fmt, threads=threads, max_context=1024, tree="off", compile="off")
    session = build_session(opts, mode="sd")
    engine = session.engine
    modes = {"sd": GenerationConfig(mode="sd", max_new_tokens=new_tokens)}
    if engine.target.supports_tree:
        modes["sd-tree"] = GenerationConfig(mode="sd", max_new_tokens=new_tokens, tree=TreeShape(*TREE), adaptive=False)
    rows = []
    t0 = time.perf_counter()
    for p in load_prompts(prompts_path):
        ids = encode(session.tokenizer, p.text)
        engine.reset()
        ar = engine.generate(ids, GenerationConfig(mode="ar", max_new_tokens=new_tokens)).tokens
        row = {"prompt_id": p.id, "category": p.category, "ar_tokens": len(ar)}
        for name, config in modes.items():
            engine.reset()
            got = engine.generate(ids, config)
            row[name] = first_difference(got.tokens, ar)
            row[f"{name}_tokens_per_pass"] = got.stats.mean_accepted_length
        rows.append(row)
    p = promise(engine.target)
    record = {"class": cpu_isa.in_force()[1], "format": str(session.target.format), "threads": threads,
              "new_tokens": new_tokens, "promise": "bit-exact" if p.exact else "up to rounding", "why": p.why,
              "draft": session.draft_id, "seconds": time.perf_counter() - t0, "rows": rows}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out)


def table(out_dir: Path, names: list[str]) -> str:
    lines = ["| class | format | promise | mode | prompts identical to ar | first differing token (prompt: index) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        path = out_dir / f"{name}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text(encoding="utf-8"))
        cls, fmt = name.split("-", 1)
        for mode in ("sd", "sd-tree"):
            got = [row for row in r["rows"] if mode in row]
            if not got:
                continue
            diff = [f"{row['prompt_id']}: {row[mode]}" for row in got if row[mode] is not None]
            same = len(got) - len(diff)
            lines.append(f"| {cls} | {fmt} | {r['promise']} | {mode} | {same} / {len(got)} | {', '.join(diff) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "exactness")
    ap.add_argument("--classes", default="native", help="comma-separated: native, avx512_bf16, avx512, avx2")
    ap.add_argument("--formats", default="none,int8,int4", help="comma-separated --quant values")
    ap.add_argument("--prompts", type=Path, default=ROOT / "docs" / "results" / "cpu-prompts.jsonl")
    ap.add_argument("-n", type=int, default=64, help="new tokens a prompt")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--one", nargs=2, metavar=("FORMAT", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        run_one(args.one[0], args.prompts, args.n, args.threads, Path(args.one[1]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    names = []
    for cls in args.classes.split(","):
        for fmt in args.formats.split(","):
            name = f"{cls}-{fmt}"
            names.append(name)
            path = args.out / f"{name}.json"
            if path.exists():
                continue
            env = {**os.environ, "VIASD_MAX_CPU_ISA": cls}
            print(f"{name}...", file=sys.stderr, flush=True)
            with open(args.out / f"{name}.log", "w", encoding="utf-8") as log:
                done = subprocess.run([sys.executable, __file__, "--one", fmt, str(path), "--prompts", str(args.prompts),
                                       "-n", str(args.n), "--threads", args.threads], env=env, stdout=log, stderr=log)
            if done.returncode != 0:
                print(f"{name} failed: see {args.out / (name + '.log')}", file=sys.stderr)
    print(table(args.out, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
