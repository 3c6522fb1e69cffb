"""`viasd bench --quant none,int8,int4 --out DIR`: one bench process per weight format, one table.

Every format runs the same bench (measure.py) in its own process (its own peak memory, nothing
shared between formats) with the same option values, --quant set to the format, and writes
DIR/<format>/; the values travel to the process as JSON on its stdin (`python -m
viasd_core.bench.formats`). The summaries are then combined into DIR/formats.json, each row
compared with fp32's `ar` and `hf` when `none` is one of the formats (the baseline of the same
invocation). Resumable: a format whose DIR/<format>/summary.json exists is read, not run again.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

from viasd_core.bench.files import check_out
from viasd_core.bench.harness import BenchConfig
from viasd_core.bench.measure import PromptSource, measure
from viasd_core.errors import UsageError, ViasdError
from viasd_core.runtime.weight_format import NAMES as QUANT_CHOICES
from viasd_core.paths import atomic_write_json
from viasd_core.loading.options import ModelOptions

WORKER = [sys.executable, "-m", "viasd_core.bench.formats"]  # one format's process: the request on stdin


def split_formats(text: str) -> list[str] | None:
    """'none,int4' -> ['none', 'int4']; a single format -> None (an ordinary bench run)."""
    if "," not in text:
        return None
    formats = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [f for f in formats if f not in QUANT_CHOICES]
    if bad:
        raise UsageError(f"unknown format '{bad[0]}' in --quant: use a comma-separated subset of {','.join(QUANT_CHOICES)}")
    return formats


def format_request(opts: ModelOptions, config: BenchConfig, prompts: PromptSource, fmt: str, out: Path) -> dict:
    """What the process of format `fmt` is given: the option values with --quant FMT, its folder
    OUT/FMT, and the command line its meta block records (this one)."""
    return {"options": dataclasses.asdict(dataclasses.replace(opts, quant=fmt)), "config": dataclasses.asdict(config),
            "prompts": dataclasses.asdict(prompts), "out": str(out / fmt), "command": list(sys.argv)}


def run_formats(opts: ModelOptions, config: BenchConfig, prompts: PromptSource, formats: list[str], out: str | Path,
                log: Callable[[str], None], run=subprocess.run) -> dict:
    """Run (or read) every format's bench, each in its own process; write and return the combined
    summary (DIR/formats.json)."""
    if not out:
        raise UsageError("--quant with several formats needs --out DIR (each format writes DIR/<format>/)")
    config.validate()  # bad input is one error here, not one per process
    out = check_out(out, ("formats.json",))
    for fmt in formats:
        check_out(out / fmt)
    prompts.load()
    summaries: dict[str, dict] = {}
    for fmt in formats:
        path = out / fmt / "summary.json"
        if path.is_file():
            log(f"{fmt}: read {path} (already run)")
        else:
            log(f"{fmt}: running viasd bench --quant {fmt} ...")
            request = format_request(opts, config, prompts, fmt, out)
            proc = run(WORKER, input=json.dumps(request), capture_output=True, text=True)
            if proc.returncode != 0 or not path.is_file():
                last = (proc.stderr or "").strip().splitlines()
                raise ViasdError(f"bench --quant {fmt} failed: {last[-1] if last else f'exit {proc.returncode}'}")
        summaries[fmt] = json.loads(path.read_text(encoding="utf-8"))
    combined = {"formats": summaries, "rows": combine(summaries)}
    atomic_write_json(out / "formats.json", combined)
    log(f"wrote {out / 'formats.json'}")
    return combined


def run_format(request: dict) -> dict:
    """In a format's own process: the bench of `request` (format_request), written to its folder."""
    return measure(ModelOptions(**request["options"]), BenchConfig(**request["config"]), PromptSource(**request["prompts"]),
                   out=request["out"], command=request["command"])


def combine(summaries: dict[str, dict]) -> list[dict]:
    """A row per (format, method) that ran, compared with fp32 `ar` / `hf` where `none` ran them."""
    base = summaries.get("none", {}).get("methods", {})

    def tps(method: str) -> float | None:
        m = base.get(method, {})
        return m.get("tokens_per_s_mean") if m.get("status") == "ok" else None

    ar, hf = tps("ar"), tps("hf")
    rows = []
    for fmt, summary in summaries.items():
        for method, m in summary.get("methods", {}).items():
            if m.get("status") != "ok":
                rows.append({"format": fmt, "method": method, "status": m.get("status"), "reason": m.get("reason")})
                continue
            t = m["tokens_per_s_mean"]
            peak = m.get("peak_memory_bytes")
            rows.append({
                "format": fmt, "method": method, "status": "ok", "tokens_per_s": t,
                "x_fp32_ar": t / ar if ar else None, "x_fp32_hf": t / hf if hf else None,
                "tokens_per_pass": m.get("mean_accepted_length"), "fidelity_mean": m.get("fidelity_mean"),
                "peak_mib": peak / 2**20 if peak else None,
            })
    return rows


def main() -> int:
    """A format's process: the request on stdin; an error is one line on stderr and the exit code."""
    try:
        run_format(json.loads(sys.stdin.read()))
    except ViasdError as e:
        print(f"Error: {e.message}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
