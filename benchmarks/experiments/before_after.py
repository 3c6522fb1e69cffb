"""The same `viasd bench` on an earlier commit and on this tree, in turns: speed and tokens.

    python benchmarks/experiments/before_after.py --before 20d9644 --out DIR [--rounds 2] -- --methods ar,sd,exact -n 64 --limit 13

The earlier commit is checked out (git worktree) into DIR/before and run from there (its own
`viasd_core`, `viasd_cli` and `viasd_kernels` first on the path); this tree runs as installed. The
runs alternate, before then after, `--rounds` times, each a whole `viasd bench ... --out` process
with the arguments after `--`. Writes DIR/before_after.json (a temporary file, then renamed): each
method's tokens/s per run, the after/before ratio of the medians, the run-to-run spread of each side
(largest over smallest run), and whether every prompt's tokens were the same in every run of both
(per method). A refactor that should change nothing passes when the tokens are identical and the
ratio lies within the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worktree(rev: str, where: Path) -> dict[str, str]:
    """The environment that runs `rev`'s code: its tree at `where`, its packages first on the path."""
    if not (where / "viasd_core").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(where), rev], check=True,
                       capture_output=True)
    shim = where.parent / "before-shim"
    shim.mkdir(exist_ok=True)
    for name, folder in (("viasd_kernels", "kernels"), ("viasd_cli", "cli")):
        link = shim / name
        if not link.exists():
            link.symlink_to(where / folder)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), str(shim)])}


def bench(env: dict[str, str], out: Path, args: list[str]) -> list[dict]:
    code = "import sys; from viasd_cli.app import main; sys.argv = ['viasd', 'bench', *sys.argv[1:]]; main()"
    subprocess.run([sys.executable, "-c", code, *args, "-q", "--out", str(out)], env=env, check=True, cwd="/tmp",
                   stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier commit")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: viasd bench's arguments")
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    envs = {"before": worktree(args.before, args.out.resolve() / "before"), "after": dict(os.environ)}
    speeds: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    tokens: dict[str, set] = {}
    for r in range(args.rounds):
        for side, env in envs.items():
            rows = bench(env, args.out / f"{side}-{r}", bench_args)
            by_method: dict[str, list[dict]] = {}
            for row in rows:
                if row["status"] != "ok":  # skipped (a method this setting cannot run): said once, not timed
                    print(side, r, row["method"], row["status"], row["reason"], file=sys.stderr)
                    continue
                by_method.setdefault(row["method"], []).append(row)
            for method, mrows in by_method.items():
                wall = sum(x["wall_s"] for x in mrows)
                speeds[side].setdefault(method, []).append(sum(x["new_tokens"] for x in mrows) / wall)
                tokens.setdefault(method, set()).add(json.dumps([(x["prompt_id"], x["tokens"]) for x in mrows]))
            print(side, r, {m: round(v[-1], 2) for m, v in speeds[side].items()}, flush=True)
    result = {"before": args.before, "bench_args": bench_args, "rounds": args.rounds, "methods": {}}
    for method in speeds["after"]:
        b, a = speeds["before"].get(method, []), speeds["after"][method]
        result["methods"][method] = {
            "before_tok_s": [round(x, 2) for x in b], "after_tok_s": [round(x, 2) for x in a],
            "after_over_before": round(statistics.median(a) / statistics.median(b), 3) if b else None,
            "spread_before": round(max(b) / min(b), 3) if b else None, "spread_after": round(max(a) / min(a), 3),
            "identical_tokens": len(tokens[method]) == 1}
    tmp = args.out / "before_after.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out / "before_after.json")
    print(json.dumps(result["methods"], indent=1))


if __name__ == "__main__":
    main()
