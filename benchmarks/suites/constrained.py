"""Constrained decoding with speculation: does constrained `sd` emit constrained `ar`'s tokens, and
does it keep unconstrained `sd`'s tokens per target pass?

    python benchmarks/suites/constrained.py --prompts docs/results/cpu-prompts.jsonl --limit 13 -n 64 --out DIR

Each prompt (its first turn, with "Reply in JSON." appended) runs three times through
`viasd generate --json`, each a process of its own with the same options: unconstrained `sd`,
constrained `ar` and constrained `sd` (`--json-schema`, a small object schema below). Reported: how
many constrained `sd` texts equal constrained `ar`'s, the constrained answers that parse and validate,
and tokens per target pass (new tokens / target passes, summed over prompts) of both `sd` runs.
Writes DIR/constrained.json (temporary file, then rename). Acceptance, not speed: it may run on a
loaded machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMA = {"type": "object",
          "properties": {"answer": {"type": "string"}, "points": {"type": "array", "items": {"type": "string"}}},
          "required": ["answer"]}


def run(lines: Path, mode: str, new: int, extra: list[str]) -> list[dict]:
    cmd = ["viasd", "generate", "--lines", "--json", "--mode", mode, "-n", str(new), "-q", *extra]
    out = subprocess.run(cmd, stdin=lines.open(), capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"constrained.py: {' '.join(cmd)} failed: {out.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def tau(records: list[dict]) -> float:
    new = sum(r["stats"]["new_tokens"] for r in records)
    passes = sum(r["stats"]["target_passes"] for r in records)
    return new / passes if passes else float("nan")


def main() -> None:
    import jsonschema

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="docs/results/cpu-prompts.jsonl")
    ap.add_argument("--limit", type=int, default=13)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("extra", nargs="*", help="more `viasd generate` options (after --), e.g. -- --quant int4")
    args = ap.parse_args()
    prompts = []
    for line in Path(args.prompts).read_text().splitlines():
        if line.strip():
            turn = json.loads(line)["turns"][0]
            prompts.append(" ".join(turn.split()) + " Reply in JSON.")
    prompts = prompts[: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        lines = Path(tmp) / "prompts.txt"
        lines.write_text("\n".join(prompts) + "\n")
        schema = ["--json-schema", json.dumps(SCHEMA)]
        free_sd = run(lines, "sd", args.max_new_tokens, args.extra)
        json_ar = run(lines, "ar", args.max_new_tokens, args.extra + schema)
        json_sd = run(lines, "sd", args.max_new_tokens, args.extra + schema)
    valid = 0
    for r in json_ar:
        try:
            jsonschema.validate(json.loads(r["text"]), SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass  # cut by -n before the object closed (finish_reason 'length')
    result = {
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "options": args.extra, "schema": SCHEMA,
        "sd_equals_ar": sum(a["text"] == s["text"] for a, s in zip(json_ar, json_sd)),
        "complete_and_valid": valid,
        "finished_by_eos": sum(r["finish_reason"] == "eos" for r in json_ar),
        "tau_unconstrained_sd": round(tau(free_sd), 3),
        "tau_constrained_sd": round(tau(json_sd), 3),
        "draft": json_sd[0]["draft"] if json_sd else None,
        "texts": [{"ar": a["text"], "sd": s["text"]} for a, s in zip(json_ar, json_sd)],
    }
    result["tau_ratio"] = round(result["tau_constrained_sd"] / result["tau_unconstrained_sd"], 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "constrained.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "constrained.json")
    print(json.dumps({k: v for k, v in result.items() if k != "texts"}, indent=1))


if __name__ == "__main__":
    main()
