"""`viasd bench`: every method on the same models, prompts and seeds, in one process.

Methods
    ar           our engine, plain decoding (the baseline for `speedup_vs_ar`)
    hf           transformers `generate()`, greedy, same target (the baseline for `speedup_vs_hf`)
    hf-assisted  transformers assisted generation with the same draft model
    hf-pld       transformers prompt lookup (`prompt_lookup_num_tokens = gamma`)
    sd           our engine, two tiers (exact)
    exact        our engine, multi-tier exact (needs a calibration profile: the slim verifier)
    viasd        our engine, three tiers (lossy; needs a calibration profile)

Per (method, prompt, repeat): one timed run (perf_counter, CUDA synchronised) after `warmup` untimed
runs per method, then ONE teacher-forced target pass over the output for its fidelity (never
assumed, HF methods included). A method that cannot run is `skipped` with the reason; one that
raises is `failed` with the error, and none of its runs is kept as a result.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .bench_plots import PLOTS, write_plots  # noqa: F401  (PLOTS: the file names, part of this module's API)
from .engine import Engine, GenerationConfig
from .errors import UsageError, ViasdError
from .fidelity import fidelity
from .model import FastModel
from .prompts import Prompt, encode
from .session import Session, eos_ids, thresholds_of

METHODS = ("ar", "hf", "hf-assisted", "hf-pld", "sd", "exact", "viasd")
ENGINE_METHODS = ("ar", "sd", "exact", "viasd")
HF_METHODS = ("hf", "hf-assisted", "hf-pld")
NEEDS_DRAFT = ("sd", "exact", "viasd", "hf-assisted")
NEEDS_PROFILE = ("exact", "viasd")
PHASES = ("prefill", "draft", "slim", "verify", "other")
from .stats import TIERS  # noqa: E402  (one definition of the tier names)


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
    gamma: int = 5
    adaptive: bool = True
    warmup: int = 1
    repeats: int = 1
    seed: int = 0
    raw: bool = False  # no chat template
    viasd_profiles: list[str] = field(default_factory=list)  # extra calibrated profiles: methods viasd@<budget>

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if self.gamma < 1:
            raise UsageError(f"gamma must be at least 1 (got {self.gamma}): pass --gamma 1 or more")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0 (got {self.warmup})")
        if self.repeats < 1:
            raise UsageError(f"--repeats must be at least 1 (got {self.repeats})")


@dataclass
class Output:
    """What one run produced (the harness adds the wall time and the fidelity)."""

    tokens: list[int]
    finish_reason: str
    target_passes: int
    accepted_lengths: list[int]
    stats: object | None = None  # RunStats for our engine, None for transformers


class Skip(Exception):
    """A method that cannot run in this set-up (reported as skipped with the reason)."""


# ---------------------------------------------------------------------- our engine
class EngineRunner:
    def __init__(self, engine: Engine, config: GenerationConfig):
        self.engine = engine
        self.config = config

    def reset(self) -> None:
        self.engine.reset()  # no prefix re-use between runs: every run prefills its prompt

    def __call__(self, prompt_ids: list[int]) -> Output:
        gen = self.engine.generate(prompt_ids, self.config)
        s = gen.stats
        return Output(list(gen.tokens), gen.finish_reason, s.target_passes, list(s.accepted_lengths), s)


# ---------------------------------------------------------------------- transformers
class FullVocabHead(torch.nn.Module):
    """A draft head with Vd outputs seen as a head over the target's V: the Vd logits are scattered
    to their target ids (`vocab_map`), every other id gets -inf (never proposed)."""

    def __init__(self, head: torch.nn.Module, vocab_map: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head = head
        self.register_buffer("vocab_map", vocab_map.to(torch.long), persistent=False)
        self.vocab_size = int(vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        draft_logits = self.head(hidden)  # [..., Vd]
        if draft_logits.shape[-1] != self.vocab_map.shape[0]:  # padded rows beyond the map
            draft_logits = draft_logits[..., : self.vocab_map.shape[0]]
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.vocab_map, draft_logits)


def full_vocab_assistant(draft_hf, target_hf):
    """An assistant model transformers accepts for `target_hf`: the draft itself when its vocabulary
    is the target's; otherwise a shell of the draft's class that shares its decoder (no copy, the
    draft is not modified) under a FullVocabHead, with its own config and generation config."""
    target_vocab = target_hf.config.get_text_config().vocab_size
    target_rows = target_hf.get_output_embeddings().weight.shape[0]
    draft_rows = draft_hf.get_output_embeddings().weight.shape[0]
    vocab_map = getattr(draft_hf, "viasd_vocab_map", None)
    if vocab_map is None and draft_rows == target_rows and draft_hf.config.get_text_config().vocab_size == target_vocab:
        return draft_hf
    if vocab_map is None:  # same tokenizer, padded differently
        vocab_map = torch.arange(min(draft_rows, target_rows), device=draft_hf.device)
    config = copy.deepcopy(draft_hf.config)
    config.vocab_size = target_vocab
    with torch.device("meta"):
        shell = type(draft_hf)(config)
    prefix = draft_hf.base_model_prefix
    setattr(shell, prefix, getattr(draft_hf, prefix))
    shell.set_output_embeddings(FullVocabHead(draft_hf.get_output_embeddings(), vocab_map, target_rows))
    shell.generation_config = copy.deepcopy(draft_hf.generation_config)
    leftover = [n for n, p in shell.named_parameters() if p.is_meta]
    if leftover:
        raise ViasdError(f"could not wrap the draft for transformers assisted generation (unshared weights: {leftover[:3]})")
    return shell.eval()


def hf_accepted_lengths(prompt_len: int, total_new: int, cache_lens: list[int | None]) -> list[int]:
    """Tokens committed per target pass of transformers' generate(), from the KV-cache length seen
    at the start of each pass (pass i > 0 is fed the last committed token first). [] if unknown."""
    if not cache_lens or any(c is None for c in cache_lens):
        return []
    committed = [prompt_len] + [c + 1 for c in cache_lens[1:]]  # committed tokens before each pass
    committed.append(prompt_len + total_new)
    lengths = [b - a for a, b in zip(committed, committed[1:])]
    return lengths if all(n >= 1 for n in lengths) else []


class HFRunner:
    """transformers `generate()` on the target: greedy, assisted (draft) or prompt lookup."""

    def __init__(self, target_hf, eos: set[int], max_new_tokens: int, pad_token_id: int | None,
                 assistant=None, prompt_lookup: int | None = None, gamma: int = 5, adaptive: bool = True):
        self.model = target_hf
        self.eos = set(eos)
        self.assistant = assistant
        self.gamma = gamma
        self.adaptive = adaptive
        self.kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                           eos_token_id=sorted(self.eos) or None,
                           pad_token_id=pad_token_id if pad_token_id is not None else (min(self.eos) if self.eos else 0))
        if prompt_lookup:
            self.kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        self.device = next(target_hf.parameters()).device

    def reset(self) -> None:
        if self.assistant is not None:  # transformers adapts these in place: start every run alike
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = self.gamma
            gc.num_assistant_tokens_schedule = "heuristic" if self.adaptive else "constant"

    @torch.inference_mode()
    def __call__(self, prompt_ids: list[int]) -> Output:
        ids = torch.tensor([prompt_ids], device=self.device)
        cache_lens: list[int | None] = []

        def count(module, args, kwargs):
            cache = kwargs.get("past_key_values")
            cache_lens.append(int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else None)

        handle = self.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
            seq = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs, **extra)
        finally:
            handle.remove()
        produced = seq[0, len(prompt_ids):].tolist()
        tokens, reason = produced, "length"
        for i, t in enumerate(produced):  # same convention as our engine: stop at (and keep) EOS
            if t in self.eos:
                tokens, reason = produced[: i + 1], "eos"
                break
        lengths = hf_accepted_lengths(len(prompt_ids), len(produced), cache_lens)
        if len(tokens) < len(produced) and lengths:  # tokens after EOS were dropped: trim the last passes
            lengths = _trim_lengths(lengths, len(tokens))
        return Output(tokens, reason, len(cache_lens), lengths, None)


def _trim_lengths(lengths: list[int], total: int) -> list[int]:
    out, left = [], total
    for n in lengths:
        if left <= 0:
            break
        out.append(min(n, left))
        left -= out[-1]
    return out


# ---------------------------------------------------------------------- the harness
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
        return "torch.cuda.max_memory_allocated, reset before each method"
    return "process peak RSS (getrusage ru_maxrss): a high-water mark of the whole process, not per method"


@dataclass
class BenchResult:
    rows: list[dict]  # one per (method, prompt, repeat), plus one status line per skipped/failed method
    statuses: dict[str, dict]  # method -> {"status": ok|skipped|failed, "reason": str|None}
    peak_memory: dict[str, int]


def make_runners(session: Session, config: BenchConfig) -> dict[str, object]:
    """A runner (or a Skip) per requested method, on the session's models."""
    engine = session.engine
    target_hf = session.target.model
    eos = eos_ids(session.target)
    tok = session.tokenizer
    pad = getattr(tok, "pad_token_id", None)
    draft_id = session.draft_id
    runners: dict[str, object] = {}
    slim_engine = None
    profile_error = None
    if any(m in config.methods for m in NEEDS_PROFILE) and engine.drafter is not None:
        slim_engine, profile_error = _slim_engine(session)

    def gen_config(mode, thresholds=None):
        return GenerationConfig(mode=mode, max_new_tokens=config.max_new_tokens, gamma=config.gamma,
                                adaptive=config.adaptive, temperature=0.0, seed=config.seed, thresholds=thresholds)

    for m in config.methods:
        if m in NEEDS_DRAFT and engine.drafter is None:
            runners[m] = Skip("no draft (--draft none): this method needs a draft model or 'ngram'")
        elif m == "ar":
            runners[m] = EngineRunner(engine, gen_config("ar"))
        elif m == "sd":
            runners[m] = EngineRunner(engine, gen_config("sd"))
        elif m in NEEDS_PROFILE:
            if slim_engine is None:
                runners[m] = Skip(profile_error)
            else:
                runners[m] = EngineRunner(slim_engine, gen_config(m, thresholds_of(session.profile)))
        elif m == "hf":
            runners[m] = HFRunner(target_hf, eos, config.max_new_tokens, pad)
        elif m == "hf-pld":
            runners[m] = HFRunner(target_hf, eos, config.max_new_tokens, pad, prompt_lookup=config.gamma)
        elif m == "hf-assisted":
            if draft_id == "ngram":
                runners[m] = Skip("the draft is prompt lookup ('ngram'), not a model: hf-pld is its transformers counterpart")
                continue
            try:
                draft_hf = session.draft.model if session.draft is not None else engine.drafter.model.hf_model
                assistant = full_vocab_assistant(draft_hf, target_hf)
                if assistant is draft_hf:  # transformers writes to it: give it its own generation config
                    assistant = _own_generation_config(draft_hf)
            except Exception as e:  # noqa: BLE001 - reported as this method's failure, the others still run
                runners[m] = Broken(e)
                continue
            runners[m] = HFRunner(target_hf, eos, config.max_new_tokens, pad, assistant=assistant,
                                  gamma=config.gamma, adaptive=config.adaptive)
    for name, runner in profile_runners(session, config, gen_config).items():
        runners[name] = runner
        if name not in config.methods:
            config.methods.append(name)
    return runners


def profile_runners(session: Session, config: BenchConfig, gen_config) -> dict[str, object]:
    """`viasd@<budget>` runners, one per extra calibration profile (several budgets in one run)."""
    from .profile import check_profile, read_profile
    from .router import Thresholds

    out: dict[str, object] = {}
    e = session.engine
    for path in config.viasd_profiles:
        prof = read_profile(path)
        check_profile(prof, session.target.model_id, session.draft_id, session.options.quant, e.target.device.type,
                      e.target.shape.n_layers, path)
        slim = FastModel(session.target.model, layer_ids=prof.layer_ids, max_len=e.target.max_len, name="slim")
        engine = Engine(e.target, e.tokenizer, drafter=e.drafter, slim=slim, eos_token_ids=e.eos)
        out[f"viasd@{prof.budget:g}"] = EngineRunner(engine, gen_config("viasd", Thresholds(prof.theta_accept, prof.theta_slim)))
    return out


class Broken:
    """A method whose set-up raised: running it re-raises, so the harness reports it failed."""

    def __init__(self, error: Exception):
        self.error = error

    def reset(self) -> None:
        pass

    def __call__(self, prompt_ids):
        raise self.error


def _own_generation_config(model):
    """The model with a private copy of its generation config, so that transformers' in-place
    adaptation of `num_assistant_tokens` never leaks into the config the model was loaded with."""
    model.generation_config = copy.deepcopy(model.generation_config)
    return model


def _slim_engine(session: Session):
    """An engine with a slim verifier from the calibration profile, sharing target and drafter;
    (None, reason naming the calibrate command) when there is no usable profile."""
    from .profile import find_profile

    if session.profile is None:
        target_fast = session.engine.target
        try:
            session.profile = find_profile(session.target.model_id, session.draft_id, session.options.quant,
                                           target_fast.device.type, target_fast.shape.n_layers,
                                           explicit=session.options.profile)
        except ViasdError as e:
            return None, e.message
    slim = FastModel(session.target.model, layer_ids=session.profile.layer_ids, max_len=session.engine.target.max_len, name="slim")
    e = session.engine
    return Engine(e.target, e.tokenizer, drafter=e.drafter, slim=slim, eos_token_ids=e.eos), None


def run_bench(session: Session, prompts: list[Prompt], config: BenchConfig,
              on_run: Callable[[str, str], None] | None = None, runners: dict | None = None) -> BenchResult:
    """Run every method over every prompt `repeats` times (after `warmup` untimed runs per method)."""
    config.validate()
    device = session.engine.device
    encoded = [(p, encode(session.tokenizer, p.text, raw=config.raw)) for p in prompts]
    runners = runners if runners is not None else make_runners(session, config)
    rows: list[dict] = []
    statuses: dict[str, dict] = {}
    peaks: dict[str, int] = {}
    per_method = len(prompts) * config.repeats
    for method in config.methods:
        runner = runners[method]
        if isinstance(runner, Skip):
            statuses[method] = {"status": "skipped", "reason": str(runner)}
            rows.append(status_row(method, "skipped", str(runner)))
            if on_run:
                on_run(method, "skipped", per_method)
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        method_rows: list[dict] = []
        done = 0
        try:
            for i in range(config.warmup):
                runner.reset()
                torch.manual_seed(config.seed)
                runner(encoded[i % len(encoded)][1])
            for prompt, ids in encoded:
                for rep in range(config.repeats):
                    runner.reset()
                    torch.manual_seed(config.seed)
                    t0 = _clock(device)
                    out = runner(ids)
                    wall = _clock(device) - t0
                    fid = fidelity(session.target.model, ids, out.tokens)
                    method_rows.append(result_row(method, prompt, rep, ids, out, wall, fid))
                    done += 1
                    if on_run:
                        on_run(method, prompt.id, 1)
        except Exception as e:  # noqa: BLE001 - a broken method must not stop the others
            reason = e.message if isinstance(e, ViasdError) else f"{type(e).__name__}: {e}"
            statuses[method] = {"status": "failed", "reason": reason}
            rows.append(status_row(method, "failed", reason))
            if on_run:
                on_run(method, "failed", per_method - done)
            continue
        statuses[method] = {"status": "ok", "reason": None}
        peaks[method] = peak_memory_bytes(device)
        rows.extend(method_rows)
    return BenchResult(rows, statuses, peaks)


def status_row(method: str, status: str, reason: str) -> dict:
    row = {k: None for k in ROW_FIELDS}
    row.update(method=method, status=status, reason=reason)
    return row


ROW_FIELDS = ("method", "category", "prompt_id", "repeat", "status", "reason", "prompt_tokens", "new_tokens",
              "finish_reason", "wall_s", "tokens_per_s", "target_passes", "steps", "accepted_lengths", "draft_tokens",
              "position_attempts", "position_accepts", "tier_counts", "tier_shares", "fidelity", "times", "tokens")


def result_row(method: str, prompt: Prompt, repeat: int, ids: list[int], out: Output, wall: float, fid: float) -> dict:
    s = out.stats
    n = len(out.tokens)
    row = {
        "method": method, "category": prompt.category, "prompt_id": prompt.id, "repeat": repeat, "status": "ok",
        "reason": None, "prompt_tokens": len(ids), "new_tokens": n, "finish_reason": out.finish_reason,
        "wall_s": wall, "tokens_per_s": n / wall if wall > 0 else 0.0, "target_passes": out.target_passes,
        "steps": None, "accepted_lengths": out.accepted_lengths, "draft_tokens": None, "position_attempts": None,
        "position_accepts": None, "tier_counts": None, "tier_shares": None, "fidelity": fid, "times": None,
        "tokens": list(out.tokens),
    }
    if s is not None:
        counts = {t: int(s.tier_counts.get(t, 0)) for t in TIERS}
        total = sum(counts.values())
        phases = {"prefill": s.time_prefill, "draft": s.time_draft, "slim": s.time_slim, "verify": s.time_verify}
        phases["other"] = max(0.0, s.time_total - sum(phases.values()))
        row.update(steps=s.steps, draft_tokens=s.draft_tokens, position_attempts=list(s.position_attempts),
                   position_accepts=list(s.position_accepts), tier_counts=counts,
                   tier_shares={t: (c / total if total else 0.0) for t, c in counts.items()}, times=phases)
    return row


# ---------------------------------------------------------------------- summary
def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0 if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(rows: list[dict], statuses: dict[str, dict], peaks: dict[str, int] | None = None,
              methods: list[str] | None = None) -> dict[str, dict]:
    """Per method, recomputed from the result rows only (status 'ok')."""
    peaks = peaks or {}
    methods = methods or list(statuses)
    ok = {m: [r for r in rows if r["method"] == m and r["status"] == "ok"] for m in methods}
    tps = {m: _mean([r["tokens_per_s"] for r in rs]) for m, rs in ok.items()}
    cats = sorted({r["category"] for rs in ok.values() for r in rs})
    cat_tps = {m: {c: _mean([r["tokens_per_s"] for r in rs if r["category"] == c]) for c in cats} for m, rs in ok.items()}
    out: dict[str, dict] = {}
    for m in methods:
        st = statuses.get(m, {"status": "failed", "reason": "not run"})
        rs = ok[m]
        entry = {"status": st["status"], "reason": st["reason"], "runs": len(rs)}
        if st["status"] != "ok" or not rs:
            out[m] = entry
            continue
        new = sum(r["new_tokens"] for r in rs)
        passes = sum(r["target_passes"] for r in rs)
        lengths = [n for r in rs for n in (r["accepted_lengths"] or [])]
        att = _sum_lists([r["position_attempts"] for r in rs if r["position_attempts"] is not None])
        acc = _sum_lists([r["position_accepts"] for r in rs if r["position_accepts"] is not None])
        steps = [r["steps"] for r in rs if r["steps"] is not None]
        drafted = [r["draft_tokens"] for r in rs if r["draft_tokens"] is not None]
        counts = [r["tier_counts"] for r in rs if r["tier_counts"] is not None]
        fids = [r["fidelity"] for r in rs]
        entry.update(
            prompts=len({r["prompt_id"] for r in rs}),
            tokens_per_s_mean=tps[m],
            tokens_per_s_std=_std([r["tokens_per_s"] for r in rs]),
            speedup_vs_ar=_ratio(tps[m], tps.get("ar")),
            speedup_vs_hf=_ratio(tps[m], tps.get("hf")),
            new_tokens_mean=new / len(rs),
            wall_s_mean=_mean([r["wall_s"] for r in rs]),
            mean_accepted_length=new / passes if passes else None,
            target_passes_per_token=passes / new if new else None,
            accepted_length_counts=_histogram(lengths),
            acceptance_rate=(sum(acc) / sum(att)) if att and sum(att) else None,
            acceptance_by_position=[a / t if t else 0.0 for a, t in zip(acc, att)] if att else None,
            mean_block_length=(sum(drafted) / sum(steps)) if steps and sum(steps) else None,
            target_passes_per_step=(passes / sum(steps)) if steps and sum(steps) else None,
            tier_shares=_shares(counts),
            fidelity_mean=_mean(fids),
            fidelity_min=min(fids),
            peak_memory_bytes=peaks.get(m),
            by_category={c: {"tokens_per_s_mean": cat_tps[m][c], "speedup_vs_ar": _ratio(cat_tps[m][c], cat_tps.get("ar", {}).get(c))}
                         for c in cats if cat_tps[m][c] is not None},
            breakdown=_breakdown([r for r in rs if r["times"] is not None]),
        )
        out[m] = entry
    return out


def _sum_lists(lists: list[list[int]]) -> list[int]:
    n = max((len(x) for x in lists), default=0)
    return [sum(x[j] for x in lists if j < len(x)) for j in range(n)]


def _histogram(values: list[int]) -> dict[str, int] | None:
    if not values:
        return None
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


def _shares(counts: list[dict]) -> dict[str, float] | None:
    if not counts:
        return None
    total = {t: sum(c.get(t, 0) for c in counts) for t in TIERS}
    n = sum(total.values())
    return {t: (v / n if n else 0.0) for t, v in total.items()}


def _breakdown(rows: list[dict]) -> dict[str, dict] | None:
    """Where the time of our engine's runs goes: share of the run time and ms per new token."""
    if not rows:
        return None
    total = {p: sum(r["times"][p] for r in rows) for p in PHASES}
    all_time = sum(total.values())
    new = sum(r["new_tokens"] for r in rows)
    return {p: {"share": total[p] / all_time if all_time else 0.0, "ms_per_token": 1000 * total[p] / new if new else 0.0}
            for p in PHASES}


# ---------------------------------------------------------------------- meta and files
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        viasd_version = version("viasd")
    except PackageNotFoundError:
        viasd_version = "unknown"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "viasd": viasd_version,
            "python": platform.python_version()}


def make_meta(device: torch.device, label: str = "measurement", **extra) -> dict:
    return {
        "label": label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": list(sys.argv),
        "device": str(device),
        "device_name": device_name(device),
        "torch_threads": torch.get_num_threads(),
        **versions(),
        **extra,
    }


def session_meta(session: Session, config: BenchConfig, prompts_source: str | None, n_prompts: int) -> dict:
    t = session.target
    profile = session.profile
    return make_meta(
        session.engine.device,
        target={"id": t.model_id, "path": str(t.path), "revision": t.revision, "quant": t.quant},
        draft={"id": session.draft_id, "path": str(session.draft.path) if session.draft else None,
               "revision": session.draft.revision if session.draft else None,
               "quant": session.draft.quant if session.draft else None},
        quant=session.options.quant,
        draft_quant=session.options.draft_quant,
        dtype=str(session.engine.target.dtype).replace("torch.", ""),
        profile=({"layer_ids": profile.layer_ids, "n_layers": profile.n_layers, "theta_accept": profile.theta_accept,
                  "theta_slim": profile.theta_slim, "budget": profile.budget} if profile else None),
        methods=list(config.methods), gamma=config.gamma, adaptive=config.adaptive,
        max_new_tokens=config.max_new_tokens, warmup=config.warmup, repeats=config.repeats, seed=config.seed,
        greedy=True, prompts=prompts_source or "shipped default set", n_prompts=n_prompts,
        peak_memory=peak_memory_source(session.engine.device),
    )


def _clean(x):
    """JSON-safe: NaN/inf -> None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x




def write_outputs(out_dir: str | Path, rows: list[dict], summary: dict) -> list[Path]:
    """results.jsonl, summary.json and the PNG plots under out_dir; returns the paths written."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ViasdError(f"cannot create --out folder '{out_dir}': {e.strerror}")
    results = out / "results.jsonl"
    results.write_text("".join(json.dumps(_clean(r)) + "\n" for r in rows), encoding="utf-8")
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(_clean(summary), indent=2) + "\n", encoding="utf-8")
    return [results, summary_path] + write_plots(out, rows, summary["methods"])
