"""`viasd doctor`: device, versions, compiled/CUDA-graph status, exactness checks and a speed probe."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from viasd_core.frontends.doctor import run_doctor
from viasd_core.frontends.doctor_checks import FAIL, PASS
from viasd_core.machine import packed_way
from viasd_core.errors import UsageError
from viasd_core.loading.prompts import default_prompts, encode
from viasd_core.session import build_session
from viasd_core.loading.options import ModelOptions

from .app import app
from .options import handle_errors, model_options

EXAMPLES = """
EXAMPLES

  viasd doctor                                   (the embedded pair, this machine)

  viasd doctor -m Qwen/Qwen2.5-7B-Instruct -d Qwen/Qwen2.5-0.5B-Instruct --json

Exit code 1 when a check fails: the compiled pass differs from the eager one, or sd / exact emit
other greedy tokens than ar. Where the engine promises bit-exact passes (float32, int8 and int4 on a
CPU) any divergence fails; where kernels round by pass width (bitsandbytes 8bit/4bit, compiled
passes, a GPU) only one beyond a rounding flip of a near-tie. `exactness` in the report says which
promise applies; --json gives the margin at each first divergence.
"""


def _shown(key: str, value) -> str:
    """An environment value as the table shows it."""
    if value is None:
        return "not measured" if key in ("compile_seconds", "cuda_graphs", "cuda_graphs_recorded") else "none"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if key == "bf16_products" and isinstance(value, dict):
        timed = f" (a product: {value['bf16_ms']:g} ms bfloat16, {value['fp32_ms']:g} ms float32)" if "bf16_ms" in value else ""
        return ("pay" if value.get("pays") else "do not pay: int8/int4 prefill and training use float32") + timed
    if key == "packed_way" and isinstance(value, dict):
        way, why = packed_way.shown(value)
        return f"{way} ({why})"
    return str(value)


@app.command(epilog=EXAMPLES)
@handle_errors
@model_options
def doctor(
    *,
    opts: ModelOptions,
    prompts: Annotated[int, typer.Option("--prompts", help="How many shipped prompts the checks run on.")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="New tokens per prompt and check.")] = 32,
    speed: Annotated[bool, typer.Option("--speed/--no-speed", help="Run the short ar vs sd speed probe, and measure --quant auto and --tree auto again.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="The report as one JSON object on stdout.")] = False,
):
    """Check that viasd runs right on this machine, and how fast."""
    if prompts < 1 or max_new_tokens < 1:
        raise UsageError("--prompts and --max-new-tokens must be at least 1")
    err = Console(stderr=True)
    # long_lived: where `serve` would compile on this machine, doctor compiles too and checks it
    session = build_session(opts, mode="sd", progress=lambda msg: err.print(msg, style="dim", soft_wrap=True),
                            refresh=speed, long_lived=True)
    ids = [encode(session.tokenizer, p.text) for p in default_prompts()[:prompts]]
    report = run_doctor(session, ids, max_new_tokens=max_new_tokens, speed=speed)
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
    else:
        out = Console()
        env = Table(title="viasd doctor", show_header=False)
        for key, value in report.environment.items():
            env.add_row(key, _shown(key, value))
        out.print(env)
        if report.machine:
            machine = Table("decision", "version", "chosen", "why", title="machine profile (in the order decided)")
            for d in report.machine["decisions"]:
                machine.add_row(d["decision"], "-" if d["version"] is None else str(d["version"]),
                                d["value"] or "not decided here", d["reason"] or "")
            out.print(machine)
        checks = Table("check", "result", "detail")
        style = {PASS: "green", FAIL: "bold red"}
        for c in report.checks:
            checks.add_row(c.name, f"[{style.get(c.status, 'yellow')}]{c.status}[/]", c.detail)
        out.print(checks)
        if report.speed:
            for mode in ("ar", "sd"):
                if mode in report.speed:
                    s = report.speed[mode]
                    out.print(f"{mode}: {s['tokens_per_s']:.1f} tokens/s, {s['tokens_per_target_pass']:.2f} tokens per target pass")
            if "sd_speedup" in report.speed:
                out.print(f"sd / ar: {report.speed['sd_speedup']:.2f}x")
        if report.format_curves:
            formats = list(report.format_curves)
            curve = Table("verify pass width", *(f"{fmt} ms" for fmt in formats),
                          title="verify curve per format (target)")
            for width in next(iter(report.format_curves.values())):
                curve.add_row(width, *(f"{report.format_curves[fmt][width] * 1000:.1f}" for fmt in formats))
            out.print(curve)
        elif report.tree and report.tree["options"]:
            curve = Table("verify pass width", "ms", title="this machine's verify curve (target)")
            for width, seconds in report.tree["verify_seconds"].items():
                curve.add_row(width, f"{seconds * 1000:.1f}")
            out.print(curve)
            options = Table("option", "tokens per pass", "draft ms", "expected tokens/s", title="--tree auto")
            for o in report.tree["options"]:
                options.add_row(o["name"], f"{o['tau']:.2f}", f"{o['draft_seconds'] * 1000:.1f}", f"{o['tokens_per_s']:.1f}")
            out.print(options)
        if report.tree:
            out.print(f"draft trees: {report.tree['reason']}")
        if report.first_block:
            out.print(f"sd's first block without -g: {report.first_block['gamma']} drafts ({report.first_block['reason']})")
    if not report.ok:
        raise typer.Exit(1)
