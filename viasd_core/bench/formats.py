"""`viasd bench --quant none,int8,int4 --out DIR`: one bench process per weight format, one table.

Every format runs `viasd bench` in its own process with the same arguments (its own peak memory,
nothing shared between formats) and writes DIR/<format>/; the summaries are then combined into
DIR/formats.json, each row compared with fp32's `ar` and `hf` when `none` is one of the formats
(the baseline of the same invocation). Resumable: a format whose DIR/<format>/summary.json exists
is read, not run again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

from viasd_core.errors import UsageError, ViasdError
from viasd_core.decoding.weight_format import NAMES as QUANT_CHOICES
from viasd_core.paths import atomic_write_json


def split_formats(text: str) -> list[str] | None:
    """'none,int4' -> ['none', 'int4']; a single format -> None (an ordinary bench run)."""
    if "," not in text:
        return None
    formats = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [f for f in formats if f not in QUANT_CHOICES]
    if bad:
        raise UsageError(f"unknown format '{bad[0]}' in --quant: use a comma-separated subset of {','.join(QUANT_CHOICES)}")
    return formats


def format_args(args: list[str], fmt: str, out: Path) -> list[str]:
    """`viasd bench` arguments for one format: --quant FMT, --out OUT/FMT, JSON on stdout, quiet."""
    return [*args, "--quant", fmt, "--out", str(out / fmt), "--json", "--quiet"]


def run_formats(args: list[str], formats: list[str], out: str | Path, log: Callable[[str], None],
                run=subprocess.run) -> dict:
    """Run (or read) every format's bench; write and return the combined summary."""
    out = Path(out)
    summaries: dict[str, dict] = {}
    for fmt in formats:
        path = out / fmt / "summary.json"
        if path.is_file():
            log(f"{fmt}: read {path} (already run)")
        else:
            log(f"{fmt}: running viasd bench --quant {fmt} ...")
            proc = run([sys.executable, "-m", "viasd_cli", "bench", *format_args(args, fmt, out)],
                       capture_output=True, text=True)
            if proc.returncode != 0 or not path.is_file():
                last = (proc.stderr or "").strip().splitlines()
                raise ViasdError(f"bench --quant {fmt} failed: {last[-1] if last else f'exit {proc.returncode}'}")
        summaries[fmt] = json.loads(path.read_text(encoding="utf-8"))
    combined = {"formats": summaries, "rows": combine(summaries)}
    atomic_write_json(out / "formats.json", combined)
    return combined


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
