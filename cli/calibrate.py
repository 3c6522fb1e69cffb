"""`viasd calibrate`: the slim view (layers x weight format) and tier thresholds for a target/draft pair."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from viasd_core.calibration.calibrate import (DEFAULT_BUDGET, DEFAULT_SKIP_RATIO, CalibrationMissed, ProfileNotSaved,
                                               check_profile_path, run_calibration)
from viasd_core.calibration.candidates import SLIM_FORMAT_CHOICES
from viasd_core.speculation.stats import format_fidelity
from viasd_core.errors import ViasdError
from viasd_core.loading.prompts import load_prompts
from viasd_core.loading.options import ModelOptions

from .app import app
from .options import GammaOpt, handle_errors, model_options

WrittenProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", "--out",
    help="Write the calibration profile to this file (atomically; --out is the same option). Default: the config "
         "directory, where generate, chat and bench find the profile of this pair on their own; give them "
         "--profile with this path otherwise.")]

EXAMPLES = """
EXAMPLES

  viasd calibrate                                   (embedded pair, shipped prompts, budget 0.01)

  viasd calibrate --budget 0.03 --skip-ratio 0.5    (allow 3% fidelity loss, skip half the layers)

  viasd calibrate --quant none --slim-formats int4  (fp32 target; try slim views on an int4 copy of it)

  viasd calibrate -m ./target -d ./draft --prompts spec_bench.jsonl --limit 40

  viasd calibrate --profile runs/profile.json        (then: viasd bench --profile runs/profile.json)
"""


def report_table(report) -> Table:
    p = report.profile
    v = report.heldout_viasd.stats
    table = Table(title="viasd calibration", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    sh = v.tier_shares
    rows = [
        ("slim view (chosen)", p.view.describe(p.n_layers)),
        ("slim top-1 agreement (search text)", f"{p.slim_agreement:.3f}"),
        ("best random mask agreement", f"{report.search.random_best.agreement:.3f}" if report.search.random_best else "-"),
        ("theta_accept / theta_slim / theta_confidence", f"{p.theta_accept:.4f} / {p.theta_slim:.4f} / {p.theta_confidence:.4f}"),
        ("budget (max fidelity loss)", f"{p.budget}"),
        ("fit fidelity (replayed)", format_fidelity(p.fit_fidelity)),
        ("held-out fidelity (measured)", format_fidelity(p.heldout_fidelity)),
        ("modeled tokens/s viasd / sd", f"{report.fit.modeled_tokens_per_s:.1f} / {report.fit.sd_modeled_tokens_per_s:.1f}"),
        ("measured tokens/s viasd / sd (held-out)", f"{v.tokens_per_s:.1f} / {report.heldout_sd.stats.tokens_per_s:.1f}"),
        ("tier shares accept / slim / full+bonus", f"{sh['accept']:.2f} / {sh['slim']:.2f} / {sh['full'] + sh['bonus']:.2f}"),
        ("mean accepted length (tokens/target pass)", f"{v.mean_accepted_length:.2f}"),
        ("pass cost target / slim / draft (ms)", f"{p.costs['target'] * 1e3:.1f} / {p.costs['slim'] * 1e3:.1f} / {p.costs['draft'] * 1e3:.1f}"),
        ("prompts fit / held-out", f"{report.n_fit} / {report.n_heldout}"),
    ]
    for k, val in rows:
        table.add_row(k, val)
    return table


def candidates_table(report) -> Table:
    """Every slim view calibration measured: what the choice was made from."""
    table = Table(title="slim views measured (fit prompts)", show_header=True)
    for column in ("view", "extra memory", "agreement", "pass cost vs target", "thresholds accept / slim / confidence",
                   "modeled vs sd"):
        table.add_column(column, justify="left" if column == "view" else "right")
    n_layers, target = report.profile.n_layers, report.costs["target"]
    for c in report.candidates:
        name = c.view.describe(n_layers) + (" (chosen)" if c is report.chosen else "")
        if c.fit is None:
            table.add_row(name, "-", "-", "-", "-", f"skipped: {c.skipped}")
            continue
        th = c.fit.thresholds
        table.add_row(name, f"{c.extra_bytes / 2**20:.0f} MiB", f"{c.agreement:.3f}", f"{c.costs['slim'] / target:.2f}",
                      f"{th.accept:.3f} / {th.slim:.3f} / {th.confidence:.3f}" if th.active else "off (as sd)",
                      f"{c.speedup:.2f}x" if c.speedup is not None else "not measured")
    return table


@app.command(epilog=EXAMPLES)
@handle_errors
@model_options(profile=WrittenProfileOpt)
def calibrate(
    *,
    opts: ModelOptions,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="JSONL (turns/prompt field) or plain text; default: the shipped set.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Use at most this many prompts.")] = None,
    budget: Annotated[float, typer.Option("--budget", help="Largest fidelity loss allowed, in (0, 1).")] = DEFAULT_BUDGET,
    skip_ratio: Annotated[float, typer.Option("--skip-ratio", help="Fraction of layers the slim verifier skips, in [0, 0.9].")] = DEFAULT_SKIP_RATIO,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="New tokens per calibration prompt.")] = 96,
    gamma: GammaOpt = 5,
    force: Annotated[bool, typer.Option("--force", help="Save the profile even if it misses the budget on held-out prompts.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON on stdout.")] = False,
    slim_formats: Annotated[str, typer.Option("--slim-formats", help=f"Weight formats of the target's copies to try as slim views besides its own weights: {SLIM_FORMAT_CHOICES}. auto: every format below the target's precision.")] = "auto",
):
    """Find the slim verifier and calibrate the tier thresholds to a fidelity budget."""
    check_profile_path(opts.profile)  # also in run_calibration; here before the progress bars draw anything
    prompt_list = load_prompts(prompts, limit=limit)
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bars:
        def progress(label, total):
            task = bars.add_task(label, total=total)
            return lambda: bars.advance(task)

        try:
            report = run_calibration(opts, prompt_list, budget=budget, skip_ratio=skip_ratio, max_new_tokens=max_new_tokens,
                                     gamma=gamma, force=force, slim_formats=slim_formats, log=err.print, progress=progress)
        except CalibrationMissed as e:
            err.print(candidates_table(e.report))
            err.print(report_table(e.report))
            raise ViasdError(str(e))
        except ProfileNotSaved as e:  # not written where it belongs at the end: e names where it is
            report, unsaved = e.report, e
        else:
            unsaved = None
    if as_json or (unsaved is not None and unsaved.report.saved_to is None):  # written nowhere: the JSON on stdout
        typer.echo(json.dumps(report.profile.to_json(), indent=2))
    if not as_json:
        Console().print(candidates_table(report))
        Console().print(report_table(report))
    if unsaved is not None:
        raise unsaved
    err.print(f"profile saved to {report.saved_to}" + ("" if report.met_budget else " (forced: it MISSES the budget)"))
