"""`viasd bench`: ar, transformers (plain, assisted, prompt lookup), sd, exact and viasd on the same
models, prompts and seeds in one process; a table on stdout, files and plots with --out."""

from __future__ import annotations

import functools
import sys
from contextlib import ExitStack
from typing import Annotated, Optional

import typer

from viasd_core.bench import harness as core
from viasd_core.bench.files import OutputsNotWritten, summary_json
from viasd_core.bench.formats import run_formats, split_formats
from viasd_core.bench.measure import PromptSource, measure, project
from viasd_core.speculation.draft_policy import UNMEASURED_START
from viasd_core.errors import UsageError
from viasd_core.loading.options import ModelOptions

from .app import app
from .options import AdaptiveOpt, GammaOpt, MinConfidenceOpt, handle_errors, model_options

EXAMPLES = """
EXAMPLES

  viasd bench --out runs/smollm2                        (every method, shipped prompts)

  viasd bench -m Qwen/Qwen2.5-7B-Instruct -d Qwen/Qwen2.5-0.5B-Instruct --prompts spec_bench.jsonl --limit 80 --out runs/qwen

  viasd bench --methods ar,hf,sd -n 64 --repeats 3 --breakdown

  viasd bench --json --methods ar,sd > summary.json

  viasd bench --synthetic llama-3-8b --acceptance-from runs/qwen/summary.json     (PROJECTION, on a GPU)
"""


def _table_console():
    from rich.console import Console

    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _gamma_text(meta: dict) -> str:
    """The block length a run was given, or 'auto' with the first block sd measured (bench's -g unset)."""
    if meta["gamma"] is not None:
        return str(meta["gamma"])
    first = meta.get("first_block")
    return f"auto (sd from {first['gamma']})" if first else "auto"


def print_summary(summary: dict, breakdown: bool) -> None:
    from rich.table import Table

    meta = summary["meta"]
    console = _table_console()
    title = (f"viasd bench: {meta['target']['id']} / draft {meta['draft']['id']} on {meta['device_name']} "
             f"({meta['dtype']}, gamma {_gamma_text(meta)}{' adaptive' if meta['adaptive'] else ''}, "
             f"{meta['n_prompts']} prompts x {meta['repeats']}, {meta['max_new_tokens']} new tokens max)")
    table = Table(title=title, title_justify="left")
    for col in ("method", "tok/s", "x ar", "x hf", "TTFT ms", "tok/pass", "accept", "tiers a/s/f", "fidelity mean/min",
                "peak MiB", "status"):
        table.add_column(col, justify="left" if col in ("method", "status", "tiers a/s/f") else "right")
    for m, s in summary["methods"].items():
        if s["status"] != "ok":
            table.add_row(m, "", "", "", "", "", "", "", "", "", f"{s['status']}: {s['reason']}")
            continue
        tiers = s.get("tier_shares")
        tiers_text = f"{tiers['accept']:.2f}/{tiers['slim']:.2f}/{tiers['full'] + tiers['bonus']:.2f}" if tiers else "-"
        peak = s.get("peak_memory_bytes")
        table.add_row(
            m, f"{s['tokens_per_s_mean']:.1f} ± {s['tokens_per_s_std']:.1f}", _fmt(s["speedup_vs_ar"]),
            _fmt(s["speedup_vs_hf"]), _fmt(s["ttft_s_mean"] * 1e3 if s.get("ttft_s_mean") is not None else None, ".0f",
                                           "not measured"),
            _fmt(s["mean_accepted_length"]), _fmt(s["acceptance_rate"]), tiers_text,
            f"{s['fidelity_mean']:.3f}/{s['fidelity_min']:.3f}", _fmt(peak / 2**20 if peak else None, ".0f"), "ok",
        )
    console.print(table)
    if breakdown:
        bt = Table(title="Where the time goes (our engine; share of run time, ms per new token)", title_justify="left")
        bt.add_column("method")
        for p in core.PHASES:
            bt.add_column(p, justify="right")
        for m, s in summary["methods"].items():
            b = s.get("breakdown")
            if b:
                bt.add_row(m, *(f"{b[p]['share'] * 100:.0f}% {b[p]['ms_per_token']:.2f}" for p in core.PHASES))
        console.print(bt)
        console.print("other = routing, acceptance, bookkeeping and host syncs outside the timed phases; "
                      "transformers methods expose no phase times.")
        print_acceptance(summary, console)


def _shares_text(shares: dict[str, float]) -> str:
    return " ".join(f"{k} {v * 100:.0f}%" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v > 0) or "-"


def print_acceptance(summary: dict, console) -> None:
    """--breakdown's second table: per method and category, acceptance by block position, tokens per
    target pass and what the steps were (plain: no draft asked; none: nothing proposed; else the source)."""
    from rich.table import Table

    at = Table(title="Where the tokens are lost (our engine's drafting methods)", title_justify="left")
    for col in ("method", "category", "steps", "tok/pass", "accept by position", "steps by kind", "kept by source"):
        at.add_column(col, justify="right" if col in ("steps", "tok/pass") else "left")
    for m, s in summary["methods"].items():
        a = s.get("acceptance_breakdown")
        if not a or a["all"]["step_counts"]["plain"] == a["all"]["steps"]:  # none, or never asked a draft (ar)
            continue
        for cat, b in [("all", a["all"]), *a["by_category"].items()]:
            at.add_row(m, cat, str(b["steps"]), _fmt(b["tokens_per_target_pass"]),
                       " ".join(f"{x:.2f}" for x in b["acceptance_by_position"][:8]) or "-", _shares_text(b["step_shares"]),
                       " ".join(f"{k} {v:.2f}" for k, v in b["acceptance_by_source"].items()) or "-")
    console.print(at)
    console.print("accept by position = of the blocks that reached a position, the share that kept it; steps by kind: "
                  "plain = the draft policy asked no draft, none = the draft proposed nothing, else who drafted; "
                  "kept by source = of the tokens each source drafted, the share the target kept.")


def print_projection(summary: dict) -> None:
    from rich.table import Table

    p = summary["projection"]
    console = _table_console()
    table = Table(title=f"PROJECTION (not a measurement): {p['target_shape']} with {p['draft_shape']}, "
                        f"{p['device']} {p['dtype']}, gamma {p['gamma']}, slim skips {p['slim_skip_ratio']:.0%} of layers",
                  title_justify="left")
    for col in ("method", "projected x ar", "tokens/step", "step ms", "acceptance", "full fraction", "acceptance from"):
        table.add_column(col, justify="left" if col in ("method", "acceptance from") else "right")
    for m, r in p["projection"].items():
        table.add_row(m, f"{r['speedup_vs_ar']:.2f}", f"{r['tokens_per_step']:.2f}", f"{r['step_s'] * 1000:.3f}",
                      _fmt(r.get("acceptance")), _fmt(r.get("full_fraction")), r.get("acceptance_source", "-"))
    console.print(table)
    c = p["costs_s"]
    console.print(f"measured costs (ms): draft step {c['draft_step'] * 1000:.3f}, slim pass over {p['gamma'] + 1} "
                  f"{c['slim_block'] * 1000:.3f}, target " + ", ".join(f"{k} tok {v * 1000:.3f}" for k, v in c["target"].items()))
    for line in p["assumptions"]:
        console.print(f"- {line}")


@app.command(epilog=EXAMPLES)
@handle_errors
@model_options
def bench(
    *,
    opts: ModelOptions,
    methods: Annotated[str, typer.Option("--methods", help=f"Comma-separated subset of {','.join(core.METHODS)}, or 'all'.")] = "all",
    gamma: GammaOpt = None,
    adaptive: AdaptiveOpt = True,
    min_confidence: MinConfidenceOpt = core.BenchConfig.min_confidence,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Largest number of new tokens per prompt.")] = 128,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Spec-Bench JSONL (category, turns) or plain text, one prompt per line (default: the shipped set).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Use the first N prompts (after --categories).")] = None,
    categories: Annotated[Optional[str], typer.Option("--categories", help="Comma-separated categories to keep, e.g. coding,math_reasoning.")] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed full prompt runs per method before timing.")] = 1,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed runs per prompt and method.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed set before every run (greedy decoding: for reproducibility only).")] = 0,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Folder for results.jsonl, summary.json and the PNG plots.")] = None,
    breakdown: Annotated[bool, typer.Option("--breakdown", help="Also print where step time goes (prefill, draft, slim, verify, other) and, per category, acceptance by block position, tokens per target pass and the share of steps plain or drafted by each source (in the JSON always: acceptance_breakdown).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary JSON on stdout instead of the table.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or loading messages on stderr.")] = False,
    synthetic: Annotated[Optional[str], typer.Option("--synthetic", help="PROJECTION on random weights of a real shape: tiny, llama-3-8b, qwen2.5-7b, vicuna-7b.")] = None,
    acceptance_from: Annotated[Optional[str], typer.Option("--acceptance-from", help="With --synthetic: the summary.json of a real run to take acceptance from.")] = None,
    force: Annotated[bool, typer.Option("--force", help="With --synthetic: allow a full-size shape on CPU.")] = False,
    viasd_profiles: Annotated[Optional[str], typer.Option("--viasd-profiles", help="Comma-separated profile files: each adds a method viasd@<budget> (several budgets in one run).")] = None,
):
    """Benchmark every method on the same models, prompts and seeds; the summary on stdout."""
    log = (lambda msg: None) if quiet else (lambda msg: typer.echo(msg, err=True))
    formats = split_formats(opts.quant)
    unsaved = None
    try:
        if synthetic is not None:
            if formats is not None:
                raise UsageError("--synthetic projects one shape on random weights: it takes a single --quant")
            show = print_projection
            summary = project(synthetic, opts, UNMEASURED_START if gamma is None else gamma, acceptance_from, force, out,
                              log)
        elif acceptance_from is not None or force:
            raise UsageError("--acceptance-from and --force only apply with --synthetic")
        else:
            config = core.BenchConfig(methods=core.parse_methods(methods), max_new_tokens=max_new_tokens, gamma=gamma,
                                      adaptive=adaptive, min_confidence=min_confidence, warmup=warmup, repeats=repeats,
                                      seed=seed, raw=raw,
                                      viasd_profiles=[p.strip() for p in (viasd_profiles or "").split(",") if p.strip()])
            source = PromptSource(prompts, limit, categories)
            if formats is not None:
                summary = run_formats(opts, config, source, formats, out, log)
                show = print_formats
            else:
                show = functools.partial(print_summary, breakdown=breakdown)
                with ExitStack() as stack:
                    summary = measure(opts, config, source, out, log, progress=None if quiet else _progress(stack))
    except OutputsNotWritten as e:  # --out failed at the end: the files went elsewhere (e names where)
        summary, unsaved = e.summary, e
    if as_json:
        sys.stdout.write(summary_json(summary))
    else:
        show(summary)
        if unsaved is not None and unsaved.fallback is None:  # written nowhere: the summary on stdout too
            sys.stdout.write(summary_json(summary))
    if unsaved is not None:
        raise unsaved


def _progress(stack: ExitStack):
    """measure's `progress`: a bar on stderr, opened (in `stack`) once the number of runs is known."""

    def start(total: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bars = stack.enter_context(Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                            TimeElapsedColumn(), console=Console(file=sys.stderr), transient=False))
        task = bars.add_task("bench", total=total)
        return lambda method, what, n: bars.update(task, advance=n, description=f"{method} {what}")

    return start


def print_formats(combined: dict) -> None:
    from rich.table import Table

    table = Table(title=f"viasd bench, one process per format ({', '.join(combined['formats'])})", title_justify="left")
    for col in ("format", "method", "tok/s", "x fp32 ar", "x fp32 hf", "tok/pass", "fidelity", "peak MiB", "status"):
        table.add_column(col, justify="left" if col in ("format", "method", "status") else "right")
    for r in combined["rows"]:
        if r["status"] != "ok":
            table.add_row(r["format"], r["method"], "", "", "", "", "", "", f"{r['status']}: {r['reason']}")
            continue
        table.add_row(r["format"], r["method"], f"{r['tokens_per_s']:.1f}", _fmt(r["x_fp32_ar"]), _fmt(r["x_fp32_hf"]),
                      _fmt(r["tokens_per_pass"]), _fmt(r["fidelity_mean"], ".3f"), _fmt(r["peak_mib"], ".0f"), "ok")
    _table_console().print(table)
