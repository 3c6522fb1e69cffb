"""One `viasd bench` run from option values: the prompts, the session, every method's runs (harness.py),
the summary and its files; and the projection on random weights of a real shape (--synthetic).

`viasd bench` calls these with what it parsed; so does each format's own process of
`--quant A,B,...` (formats.py), with the same values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from viasd_core.bench.files import check_out, make_meta, session_meta, write_or_fall_back, write_outputs, write_summary
from viasd_core.bench import harness
from viasd_core.bench.harness import BenchConfig
from viasd_core.bench.summary import summarize
from viasd_core.errors import UsageError
from viasd_core.loading.prompts import Prompt, load_prompts
from viasd_core.session import build_session
from viasd_core.loading.options import ModelOptions


@dataclass
class PromptSource:
    """Which prompts a bench runs: a file (None: the shipped set), its categories, the first `limit`."""

    path: str | None = None
    limit: int | None = None
    categories: str | None = None  # comma-separated, e.g. "coding,math_reasoning"

    def load(self) -> list[Prompt]:
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be at least 1 (got {self.limit})")
        cats = [c.strip() for c in self.categories.split(",") if c.strip()] if self.categories else None
        return load_prompts(self.path, limit=self.limit, categories=cats)


def measure(opts: ModelOptions, config: BenchConfig, prompts: PromptSource, out: str | None = None,
            log: Callable[[str], None] = lambda msg: None, progress=None, command: list[str] | None = None) -> dict:
    """Run the bench and return its summary ({"meta", "methods"}); with `out` (checked first), write
    results.jsonl, summary.json and the plots there: if that fails, they go to a fallback folder
    and files.OutputsNotWritten says where. `progress(total)`, once the number of runs is known (an extra
    profile adds a method), returns the harness's on_run callback (or None). `command`: the command
    line the meta block records (default: this process's)."""
    config.validate()
    if out:
        check_out(out)
    prompt_list = prompts.load()
    needs_draft = any(m in harness.NEEDS_DRAFT for m in config.methods) or bool(config.viasd_profiles)
    session = build_session(opts, mode="sd" if needs_draft else "ar", progress=log, need_profile=False)
    # looked up here: tests replace it. --tree auto's probe (once; cached), where sd or sd-tree needs it,
    # is said through the log: -q silences it
    runners = harness.make_runners(session, config, progress=log)
    on_run = progress(len(config.methods) * len(prompt_list) * config.repeats) if progress else None
    result = harness.run_bench(session, prompt_list, config, on_run=on_run, runners=runners)
    summary = {
        "meta": session_meta(session, config, prompts.path, len(prompt_list), command),
        "methods": summarize(result.rows, result.statuses, result.peak_memory, config.methods),
    }
    if out:
        paths = write_or_fall_back(out, lambda folder: write_outputs(folder, result.rows, summary), summary)
        log("wrote " + ", ".join(str(p) for p in paths))
    return summary


def project(synthetic: str, opts: ModelOptions, gamma: int, acceptance_from: str | None = None, force: bool = False,
            out: str | None = None, log: Callable[[str], None] = lambda msg: None) -> dict:
    """The PROJECTION of `synthetic` (loading/synthetic.py) on the options' device and dtype; with
    `out` (checked first), its summary.json is written there (or to a fallback folder, as measure's)."""
    from viasd_core.devices import resolve_device
    from viasd_core.loading import synthetic as syn

    device = resolve_device(opts.device)
    plan = syn.SyntheticPlan(name=synthetic, device=str(device), dtype=opts.dtype, gamma=gamma, force=force,
                             acceptance_from=acceptance_from)
    syn.check_plan(plan)
    if out:
        check_out(out, ("summary.json",))
    projection = syn.run_synthetic(plan, progress=log)
    summary = {"meta": make_meta(device, label=syn.LABEL, synthetic=synthetic, gamma=gamma, acceptance_from=acceptance_from),
               "projection": projection}
    if out:
        (path,) = write_or_fall_back(out, lambda folder: [write_summary(folder, summary)], summary)
        log(f"wrote {path} (a PROJECTION)")
    return summary
