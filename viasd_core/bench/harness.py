"""`viasd bench`, the harness: every method on the same models, prompts and seeds, in one process.

Methods
    ar           our engine, plain decoding (the baseline for `speedup_vs_ar`)
    hf           transformers `generate()`, greedy, same target (the baseline for `speedup_vs_hf`)
    hf-assisted  transformers assisted generation with the same draft model
    hf-pld       transformers prompt lookup (`prompt_lookup_num_tokens = gamma`)
    sd           our engine, two tiers (exact), drafting chains
    sd-tree      the same with draft token trees, of the size --tree gives (auto: chosen by
                 measuring this machine; skipped where the draft grows no trees or auto chose none)
    exact        our engine, multi-tier exact (needs a calibration profile: the slim verifier)
    viasd        our engine, three tiers (lossy; needs a calibration profile)
    ar-slim      our engine, plain decoding by the profile's slim view alone: what a user gives up
                 by running the cheap view without the tiers (lossy; needs a calibration profile)
    llama.cpp    llama-cpp-python on the embedded target's GGUF file (Q4_1), greedy, CPU (optional)

Per (method, prompt, repeat): one timed run (perf_counter, CUDA synchronised) after `warmup` untimed
runs per method, then the target teacher-forced over the output for its fidelity (speculation/fidelity.py;
never assumed, HF methods included). A method that cannot run is `skipped` with the reason; one that
raises is `failed` with the error, and none of its runs is kept as a result.

The runners are in runners.py, the summary in summary.py, the files and meta block in files.py,
the plots in plots.py; measure.py runs a whole bench from option values, formats.py one per format.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from viasd_core.bench.runners import Broken, EngineRunner, HFRunner, Output, Skip, full_vocab_assistant, llama_cpp_runner
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.speculation.draft_policy import UNMEASURED_START
from viasd_core.errors import UsageError, ViasdError
from viasd_core.speculation.fidelity import fidelity
from viasd_core.loading.drafter_factory import LOOKUPS
from viasd_core.loading.models import EMBEDDED_TARGET, eos_ids, pad_token_id
from viasd_core.loading.prompts import Prompt, encode
from viasd_core.session import GenerationRequest, Session, resolve_config, thresholds_of
from viasd_core.runtime.slim_view import SlimView, slim_verifier
from viasd_core.speculation.stats import TIERS

METHODS = ("ar", "hf", "hf-assisted", "hf-pld", "sd", "sd-tree", "exact", "viasd", "ar-slim", "llama.cpp")
NEEDS_DRAFT = ("sd", "sd-tree", "exact", "viasd", "hf-assisted")
NEEDS_PROFILE = ("exact", "viasd", "ar-slim")
PHASES = ("prefill", "draft", "slim", "verify", "other")  # where our engine's run time goes (result rows)


def parse_methods(text: str | None) -> list[str]:
    """'ar,sd' -> ['ar', 'sd'] in the given order; None / 'all' -> every method."""
    if text is None or text.strip().lower() == "all":
        return list(METHODS)
    out: list[str] = []
    for name in (t.strip().lower() for t in text.split(",")):
        if not name:
            continue
        if name not in METHODS:
            raise UsageError(f"unknown method '{name}' in --methods: use a comma-separated subset of {','.join(METHODS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise UsageError(f"--methods is empty: use a comma-separated subset of {','.join(METHODS)}")
    return out


@dataclass
class BenchConfig:
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    max_new_tokens: int = 128
    gamma: int | None = None  # None: sd starts from the block measured on this machine, the others from 5
    adaptive: bool = True
    min_confidence: float = GenerationConfig.min_confidence
    warmup: int = 1
    repeats: int = 1
    seed: int = 0
    raw: bool = False  # no chat template
    viasd_profiles: list[str] = field(default_factory=list)  # extra calibrated profiles: methods viasd@<budget>

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if self.gamma is not None and self.gamma < 1:
            raise UsageError(f"gamma must be at least 1 (got {self.gamma}): pass --gamma 1 or more")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0 (got {self.warmup})")
        if self.repeats < 1:
            raise UsageError(f"--repeats must be at least 1 (got {self.repeats})")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def peak_memory_source(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, reset before each run: the largest of the method's runs"
    return "process peak RSS (getrusage ru_maxrss): a high-water mark of the whole process, not per method"


@dataclass
class BenchResult:
    rows: list[dict]  # one per (method, prompt, repeat), plus one status line per skipped/failed method
    statuses: dict[str, dict]  # method -> {"status": ok|skipped|failed, "reason": str|None}
    peak_memory: dict[str, int]


def make_runners(session: Session, config: BenchConfig, progress=None) -> dict[str, object]:
    """A runner (or a Skip) per requested method, on the session's models; each of our engine's
    methods runs the config session.resolve_config gives its mode. `progress` hears --tree auto's
    probe where sd or sd-tree needs it (bench's log: -q silences it; the meta says what was chosen)."""
    engine = session.engine
    target_hf = session.target.model
    eos = eos_ids(session.target)
    pad = pad_token_id(session.target)
    draft_id = session.draft_id
    runners: dict[str, object] = {}
    slim_engine = None
    profile_error = None
    if any(m in config.methods for m in NEEDS_PROFILE):
        slim_engine, profile_error = _slim_engine(session)

    gamma = UNMEASURED_START if config.gamma is None else config.gamma  # the HF methods' blocks
    asked = GenerationRequest(max_new_tokens=config.max_new_tokens, gamma=config.gamma, adaptive=config.adaptive,
                              min_confidence=config.min_confidence, temperature=0.0, seed=config.seed, trees=False)

    def gen_config(mode, thresholds=None, trees=False):
        # chains start at the block measured here where -g is absent; trees (sd-tree) at gamma's default
        return resolve_config(session, dataclasses.replace(asked, mode=mode, thresholds=thresholds, trees=trees,
                                                           measured_start=not trees), progress)

    # sd's config before any runner is made: without -g it starts from the block measured on this machine
    sd_config = gen_config("sd") if "sd" in config.methods else None
    for m in config.methods:
        if m in NEEDS_DRAFT and engine.drafter is None:
            runners[m] = Skip("no draft (--draft none): this method needs a draft model or 'ngram'")
        elif m == "ar":
            runners[m] = EngineRunner(engine, gen_config("ar"))
        elif m == "sd":
            runners[m] = EngineRunner(engine, sd_config)
        elif m == "sd-tree":
            made = gen_config("sd", trees=True)
            runners[m] = (EngineRunner(engine, made) if made.tree is not None
                          else Skip(f"no draft tree: {session.tree.reason}"))
        elif m in NEEDS_PROFILE:
            if slim_engine is None:
                runners[m] = Skip(profile_error)
            elif m == "ar-slim":  # the slim view as the only model (its own KV cache, the same weights)
                alone = Engine(slim_verifier(engine.target, session.profile.view), engine.tokenizer, eos_token_ids=engine.eos,
                               context_len=engine.context_len)
                runners[m] = EngineRunner(alone, gen_config("ar"))
            else:
                runners[m] = EngineRunner(slim_engine, gen_config(m))  # the profile _slim_engine found
        elif m == "hf":
            runners[m] = HFRunner(target_hf, eos, config.max_new_tokens, pad)
        elif m == "llama.cpp":
            try:
                runners[m] = llama_cpp_runner(session.target.ref, eos, config.max_new_tokens, engine.target.max_len)
            except Exception as e:  # noqa: BLE001 - reported as this method's failure, the others still run
                runners[m] = Broken(e)
        elif m == "hf-pld":
            runners[m] = HFRunner(target_hf, eos, config.max_new_tokens, pad, prompt_lookup=gamma)
        elif m == "hf-assisted":
            if draft_id in LOOKUPS:
                runners[m] = Skip(f"the draft is a lookup ('{draft_id}'), not a model: hf-pld is its transformers counterpart")
                continue
            try:
                draft_hf = assistant_draft(session)
                if draft_hf is None:
                    runners[m] = Skip("the draft is an EAGLE-3 head: transformers' assisted generation needs a draft model")
                    continue
                assistant = full_vocab_assistant(draft_hf, target_hf)
            except Exception as e:  # noqa: BLE001 - reported as this method's failure, the others still run
                runners[m] = Broken(e)
                continue
            runners[m] = HFRunner(target_hf, eos, config.max_new_tokens, pad, assistant=assistant,
                                  gamma=gamma, adaptive=config.adaptive)
    for name, runner in profile_runners(session, config, gen_config).items():
        runners[name] = runner
        if name not in config.methods:
            config.methods.append(name)
    return runners


def assistant_draft(session: Session):
    """The HF draft model for `hf-assisted`: the session's draft model; with an EAGLE-3 head on the
    embedded target, the embedded draft model (the draft it replaced); else None."""
    if session.draft is not None:
        return session.draft.model
    drafter = session.engine.drafter
    fast = drafter.fast_models() if drafter is not None else []
    if fast:
        return fast[0].hf_model
    if session.target.model_id == EMBEDDED_TARGET:
        from viasd_core.loading.draft_model import embedded_draft_dir, load_draft

        return load_draft(embedded_draft_dir(), session.target.model, tokenizer=session.target.tokenizer)
    return None


def profile_runners(session: Session, config: BenchConfig, gen_config) -> dict[str, object]:
    """`viasd@<budget>` runners, one per extra calibration profile (several budgets in one run)."""
    from viasd_core.loading.profile import check_profile, read_profile

    out: dict[str, object] = {}
    e = session.engine
    for path in config.viasd_profiles:
        prof = read_profile(path)
        check_profile(prof, session.target.model_id, session.draft_id, session.options.quant, e.target.device.type,
                      e.target.shape.n_layers, path)
        engine = _engine_with_slim(session, prof.view)
        out[f"viasd@{prof.budget:g}"] = EngineRunner(engine, gen_config("viasd", thresholds=thresholds_of(prof)))
    return out


def _engine_with_slim(session: Session, view: SlimView) -> Engine:
    """An engine sharing the session's target and drafter, with the slim verifier of `view`."""
    e = session.engine
    engine = Engine(e.target, e.tokenizer, drafter=e.drafter, slim=slim_verifier(e.target, view),
                    eos_token_ids=e.eos, context_len=e.context_len)
    if e.compiled:
        engine.compile()
    return engine


def _slim_engine(session: Session):
    """An engine with a slim verifier from the calibration profile, sharing target and drafter;
    (None, reason naming the calibrate command) when there is no usable profile."""
    from viasd_core.loading.profile import find_profile

    if session.profile is None:
        target_fast = session.engine.target
        try:
            session.profile = find_profile(session.target.model_id, session.draft_id, session.options.quant,
                                           target_fast.device.type, target_fast.shape.n_layers,
                                           explicit=session.options.profile)
        except ViasdError as e:
            return None, e.message
    return _engine_with_slim(session, session.profile.view), None


def run_bench(session: Session, prompts: list[Prompt], config: BenchConfig,
              on_run: Callable[[str, str], None] | None = None, runners: dict | None = None) -> BenchResult:
    """Run every method over every prompt `repeats` times (after `warmup` untimed runs per method).

    The methods take turns on each prompt (prompt 1: every method, then prompt 2, ...), so a
    machine whose speed drifts during the run (another job, clocks, a shared host) weighs on every
    method alike instead of on whichever ran last. A method that fails is dropped (its rows with it)
    and the others go on. Peak memory on CUDA is the largest of the method's own runs."""
    config.validate()
    device = session.engine.device
    encoded = [(p, encode(session.tokenizer, p.text, raw=config.raw)) for p in prompts]
    made = runners is None
    runners = runners if runners is not None else make_runners(session, config)
    statuses: dict[str, dict] = {}
    peaks: dict[str, int] = {}
    per_method = len(prompts) * config.repeats
    method_rows: dict[str, list[dict]] = {}
    done: dict[str, int] = {}

    def fail(method: str, e: Exception) -> None:
        reason = e.message if isinstance(e, ViasdError) else f"{type(e).__name__}: {e}"
        statuses[method] = {"status": "failed", "reason": reason}
        method_rows[method] = [status_row(method, "failed", reason)]
        if on_run:
            on_run(method, "failed", per_method - done[method])

    for method in config.methods:
        runner = runners[method]
        if isinstance(runner, Skip):
            statuses[method] = {"status": "skipped", "reason": str(runner)}
            method_rows[method] = [status_row(method, "skipped", str(runner))]
            if on_run:
                on_run(method, "skipped", per_method)
            continue
        method_rows[method], done[method] = [], 0
        try:
            for i in range(config.warmup):
                runner.reset()
                torch.manual_seed(config.seed)
                runner(encoded[i % len(encoded)][1])
        except Exception as e:  # noqa: BLE001 - a broken method must not stop the others
            fail(method, e)
    running = [m for m in config.methods if m in done and m not in statuses]
    for prompt, ids in encoded:
        for rep in range(config.repeats):
            for method in list(running):
                runner = runners[method]
                try:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    runner.reset()
                    torch.manual_seed(config.seed)
                    t0 = _clock(device)
                    out = runner(ids)
                    wall = _clock(device) - t0
                    if device.type == "cuda":
                        peaks[method] = max(peaks.get(method, 0), peak_memory_bytes(device))
                    fid = fidelity(session.target.model, ids, out.tokens)
                    method_rows[method].append(result_row(method, prompt, rep, ids, out, wall, fid))
                except Exception as e:  # noqa: BLE001 - a broken method must not stop the others
                    fail(method, e)
                    running.remove(method)
                    continue
                done[method] += 1
                if on_run:
                    on_run(method, prompt.id, 1)
    for method in running:
        statuses[method] = {"status": "ok", "reason": None}
        if getattr(runners[method], "build", None):  # what the method ran, where it says (llama.cpp's build)
            statuses[method]["build"] = runners[method].build
        if device.type != "cuda":
            peaks[method] = peak_memory_bytes(device)  # the process's high-water mark (meta.peak_memory)
    if made:  # the runners made here end here (llama.cpp's process)
        for runner in runners.values():
            getattr(runner, "close", lambda: None)()
    rows = [row for method in config.methods for row in method_rows[method]]
    return BenchResult(rows, statuses, peaks)


def status_row(method: str, status: str, reason: str) -> dict:
    row = {k: None for k in ROW_FIELDS}
    row.update(method=method, status=status, reason=reason)
    return row


ROW_FIELDS = ("method", "category", "prompt_id", "repeat", "status", "reason", "prompt_tokens", "new_tokens",
              "finish_reason", "wall_s", "ttft_s", "tokens_per_s", "target_passes", "steps", "accepted_lengths", "draft_tokens",
              "position_attempts", "position_accepts", "tier_counts", "tier_shares", "draft_sources", "source_tokens", "policy_plain_steps",
              "fidelity", "times", "tokens")


def result_row(method: str, prompt: Prompt, repeat: int, ids: list[int], out: Output, wall: float, fid: float) -> dict:
    s = out.stats
    n = len(out.tokens)
    row = {
        "method": method, "category": prompt.category, "prompt_id": prompt.id, "repeat": repeat, "status": "ok",
        "reason": None, "prompt_tokens": len(ids), "new_tokens": n, "finish_reason": out.finish_reason,
        "wall_s": wall, "ttft_s": None if s is None else s.time_first_token,  # transformers' runs: not measured
        "tokens_per_s": n / wall if wall > 0 else 0.0, "target_passes": out.target_passes,
        "steps": None, "accepted_lengths": out.accepted_lengths, "draft_tokens": None, "position_attempts": None,
        "position_accepts": None, "tier_counts": None, "tier_shares": None, "draft_sources": None,
        "source_tokens": None, "policy_plain_steps": None, "fidelity": fid, "times": None,
        "tokens": list(out.tokens),
    }
    if s is not None:
        counts = {t: int(s.tier_counts.get(t, 0)) for t in TIERS}
        total = sum(counts.values())
        phases = {"prefill": s.time_prefill, "draft": s.time_draft, "slim": s.time_slim, "verify": s.time_verify}
        phases["other"] = max(0.0, s.time_total - sum(phases.values()))
        row.update(steps=s.steps, draft_tokens=s.draft_tokens, position_attempts=list(s.position_attempts),
                   position_accepts=list(s.position_accepts), tier_counts=counts,
                   tier_shares={t: (c / total if total else 0.0) for t, c in counts.items()}, times=phases,
                   draft_sources=dict(s.draft_sources), policy_plain_steps=s.policy_plain_steps,
                   source_tokens={k: list(v) for k, v in s.source_tokens.items()})
    return row
