"""`viasd calibrate`: choose the slim view, then fit the tier thresholds to a budget.

docs/algorithm.md sections 4 and 5:
  1. generate (exact sd) on the calibration prompts; the finished sequences are calibration text
  2. search the layer mask that keeps the slim verifier closest to the target on that text
  3. for every candidate view (the mask on the target's weights; every layer and the mask on an
     int8 / int4 twin of the target: slim_view.py): measure its agreement with the target and its
     pass cost, re-run sd with it recording, per drafted token, the gate and whether the target
     agrees (teacher-forced labels from the verification pass), and fit its thresholds on half
     of the prompts: the highest modeled throughput (pass costs measured on this machine) with
     fidelity >= 1 - budget. Keep the view with the best modeled speedup over sd
  4. validate on the other half with real viasd runs and a teacher-forced fidelity pass; a
     profile that misses the budget there is not saved (unless forced)
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from viasd_core.calibration.recording import BlockRecorder
from viasd_core.decoding.engine import Engine, GenerationConfig
from viasd_core.errors import UsageError, ViasdError
from viasd_core.decoding.fidelity import fidelity
from viasd_core.decoding.model import FastModel
from viasd_core.decoding.router import OFF, BlockRecord, ReplayOutcome, Thresholds, replay
from viasd_core.decoding.slim_view import SlimView, lower_formats, release_twins, slim_verifier, twin_bytes
from viasd_core.decoding.stats import RunStats, format_fidelity
from viasd_core.decoding.weight_formats import FORMATS

DEFAULT_BUDGET = 0.01
DEFAULT_SKIP_RATIO = 0.45
FIT_MARGIN_Z = 1.0  # the fit's fidelity margin, in standard errors (fidelity_lower_bound)


def check_budget(budget: float) -> None:
    if not 0 < budget < 1:
        extra = " (a budget of 0 allows no loss at all: use --mode exact or sd, which are lossless)" if budget == 0 else ""
        raise UsageError(f"--budget must be in (0, 1), got {budget}{extra}")


def check_skip_ratio(ratio: float) -> None:
    if not 0 <= ratio <= 0.9:
        raise UsageError(f"--skip-ratio must be in [0, 0.9], got {ratio}")


# ---------------------------------------------------------------------- layer-mask search
@dataclass
class MaskScore:
    layer_ids: list[int]
    agreement: float  # top-1 agreement with the target, teacher-forced
    kl: float  # mean KL(target || slim) per position


@dataclass
class MaskSearch:
    best: MaskScore
    random_best: MaskScore | None
    evaluations: int
    seconds: float
    history: list[MaskScore] = field(default_factory=list)


class MaskEvaluator:
    """Scores layer masks on fixed calibration sequences against the target's own logits."""

    def __init__(self, hf_model, sequences: list[list[int]]):
        self.hf_model = hf_model
        self.max_len = max(len(s) for s in sequences) + 1
        self.device = next(hf_model.parameters()).device
        self.sequences = [torch.tensor(s, dtype=torch.long, device=self.device) for s in sequences]
        full = FastModel(hf_model, max_len=self.max_len, name="target")
        self.n_layers = full.shape.n_layers
        self.target_logp = [self._logits(full, s).log_softmax(-1) for s in self.sequences]
        self.target_argmax = [lp.argmax(-1) for lp in self.target_logp]
        self.evaluations = 0

    @staticmethod
    def _logits(model: FastModel, seq: torch.Tensor) -> torch.Tensor:
        model.reset()
        return model.forward(seq, 0, n_logits=seq.shape[0])

    def score(self, layer_ids: list[int]) -> MaskScore:
        self.evaluations += 1
        slim = FastModel(self.hf_model, layer_ids=layer_ids, max_len=self.max_len, name="slim")
        agreement, kl = self.compare(slim)
        return MaskScore(sorted(layer_ids), agreement, kl)

    def compare(self, slim: FastModel) -> tuple[float, float]:
        """(top-1 agreement, mean KL(target || slim)) of any view of the target on the sequences."""
        slim.allocate(self.max_len)
        agree = total = 0
        kl_sum = 0.0
        for seq, t_logp, t_arg in zip(self.sequences, self.target_logp, self.target_argmax):
            s_logp = self._logits(slim, seq).log_softmax(-1)
            agree += int((s_logp.argmax(-1) == t_arg).sum())
            total += seq.shape[0]
            t_prob = t_logp.exp()
            kl_sum += float(torch.where(t_prob > 0, t_prob * (t_logp - s_logp), 0.0).sum())  # 0 log 0 = 0
        slim.reset()
        return agree / total, kl_sum / total


def _better(a: MaskScore, b: MaskScore) -> bool:
    return (a.agreement, -a.kl) > (b.agreement, -b.kl)


def search_layer_mask(evaluator: MaskEvaluator, skip_ratio: float, swap_rounds: int = 2, n_random: int = 6,
                      seed: int = 0, progress=None) -> MaskSearch:
    """Greedy importance ranking + local swap search; random masks of the same size as a check.

    First and last layers are always kept. Step 1 scores skipping each candidate layer alone;
    the initial mask skips the k least harmful. Step 2 tries swapping each skipped layer with
    the most promising kept ones and keeps improvements.
    """
    t0 = time.perf_counter()
    L = evaluator.n_layers
    k = int(round(skip_ratio * L))
    candidates = list(range(1, L - 1))
    k = min(k, len(candidates))
    everything = list(range(L))
    if k == 0:
        best = evaluator.score(everything)
        return MaskSearch(best, None, evaluator.evaluations, time.perf_counter() - t0, [best])
    single = {}
    for i in candidates:
        single[i] = evaluator.score([j for j in everything if j != i])
        if progress:
            progress()
    ranked = sorted(candidates, key=lambda i: (single[i].agreement, -single[i].kl), reverse=True)
    skipped = set(ranked[:k])
    best = evaluator.score([j for j in everything if j not in skipped])
    history = [best]
    for _ in range(swap_rounds):
        improved = False
        outside = [i for i in ranked if i not in skipped][:3]  # the least harmful layers still kept
        for out_layer in sorted(skipped, key=lambda i: (single[i].agreement, -single[i].kl))[:3]:
            for in_layer in outside:
                trial = (skipped - {out_layer}) | {in_layer}
                score = evaluator.score([j for j in everything if j not in trial])
                if progress:
                    progress()
                if _better(score, best):
                    best, skipped, improved = score, trial, True
                    history.append(best)
                    break
            if improved:
                break
        if not improved:
            break
    rng = random.Random(seed)
    random_best = None
    for _ in range(n_random):
        trial = set(rng.sample(candidates, k))
        score = evaluator.score([j for j in everything if j not in trial])
        if progress:
            progress()
        if random_best is None or _better(score, random_best):
            random_best = score
    return MaskSearch(best, random_best, evaluator.evaluations, time.perf_counter() - t0, history)


# ---------------------------------------------------------------------- costs
@torch.inference_mode()
def pass_costs(model: FastModel, name: str, block: int, context: int = 256, repeats: int = 7) -> dict:
    """Median seconds of `model`'s pass over `block` tokens and over 1 token after `context`
    cached positions: {name: block pass, name_1: 1-token pass}."""
    device = model.device
    ids = torch.randint(10, min(1000, model.shape.vocab_size), (context + block,), device=device)
    model.allocate(context + block + 1)

    def timed(n: int) -> float:
        model.reset()
        model.forward(ids[:context], 0, 1)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            model.forward(ids[context : context + n], context, 1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        model.reset()
        return statistics.median(times)

    one = timed(1)
    return {name: one if block == 1 else timed(block), f"{name}_1": one}


def measure_costs(target: FastModel, draft: FastModel | None, context: int = 256, block: int = 6, repeats: int = 7) -> dict:
    """Seconds of one pass, measured here: the target over `block` tokens and over 1 token
    (`target_1`), one draft token; `block` records the width. A slim view's come from pass_costs."""
    costs = {"block": block, **pass_costs(target, "target", block, context, repeats)}
    costs["draft"] = pass_costs(draft, "draft", 1, context, repeats)["draft"] if draft is not None else 0.0
    return costs


def pass_seconds(costs: dict, name: str, passes: int, positions: int) -> float:
    """Seconds of `passes` passes of model `name` over `positions` positions in all: linear in a
    pass's width between the measured 1-token and block passes (on a CPU a wider pass costs more;
    a target skipped for a few steps runs their tokens in its next pass). Flat per pass where
    only the block pass was measured."""
    block, one, width = costs[name], costs.get(f"{name}_1"), costs.get("block", 0)
    if one is None or width < 2:
        return passes * block
    per_position = max(0.0, (block - one) / (width - 1))
    return passes * one + per_position * max(0, positions - passes)


def modeled_tokens_per_s(outcome: ReplayOutcome, costs: dict) -> float:
    seconds = (outcome.drafted * costs["draft"] + pass_seconds(costs, "target", outcome.target_passes, outcome.target_positions))
    if outcome.slim_passes:
        seconds += pass_seconds(costs, "slim", outcome.slim_passes, outcome.slim_positions)
    return outcome.tokens / seconds if seconds > 0 else 0.0


def sd_outcome(blocks: list[BlockRecord]) -> ReplayOutcome:
    """What plain sd does on the same blocks: viasd with both tiers off (one target pass per
    block, no slim pass; the target's tokens up to its first disagreement, then its own)."""
    return replay(blocks, Thresholds(OFF, OFF))


# ---------------------------------------------------------------------- threshold fit
@dataclass
class Fit:
    thresholds: Thresholds
    outcome: ReplayOutcome
    modeled_tokens_per_s: float
    sd_modeled_tokens_per_s: float


def _quantiles(values: list[float], grid: int) -> list[float]:
    values = sorted(values)
    if not values:
        return []
    return [values[min(len(values) - 1, int(i / grid * (len(values) - 1)))] for i in range(grid + 1)]


def fidelity_lower_bound(outcome: ReplayOutcome, z: float = FIT_MARGIN_Z) -> float | None:
    """The Wilson lower bound, z standard errors below, of the replayed fidelity (None: no token).
    The fit prompts are few; a threshold set that only just meets the budget on them misses it on
    new text about half of the time."""
    n = outcome.tokens
    if not n:
        return None
    f = 1.0 - outcome.wrong / n
    z2 = z * z
    return (f + z2 / (2 * n) - z * math.sqrt(f * (1 - f) / n + z2 / (4 * n * n))) / (1 + z2 / n)


def fit_thresholds(blocks: list[BlockRecord], costs: dict, budget: float, grid: int = 24, confidence_grid: int = 12,
                   z: float = FIT_MARGIN_Z) -> Fit:
    """Grid search over (theta_accept, theta_slim, theta_confidence) maximizing modeled tokens/s
    subject to the replayed fidelity meeting the budget with a margin: its lower bound at z
    standard errors (fidelity_lower_bound) >= 1 - budget. Grid values are quantiles of the
    recorded gates and confidences; a threshold of OFF (> 1) disables its tier, a confidence
    threshold of 0 the condition. Without any recorded token nothing can be shown to meet the
    budget: both tiers stay off (viasd is sd)."""
    values = sorted(set([OFF, 1.0, 0.0] + _quantiles([g for b in blocks for g in b.gate], grid)))
    confidences = sorted(set([0.0] + _quantiles([c for b in blocks for c in b.confidence], confidence_grid)))
    best = None
    for confidence in confidences:
        for accept in values:
            for slim in values:
                if slim > accept:
                    continue
                th = Thresholds(accept, slim, confidence)
                outcome = replay(blocks, th)
                bound = fidelity_lower_bound(outcome, z)
                if bound is None or bound < 1 - budget:
                    continue
                tps = modeled_tokens_per_s(outcome, costs)
                if best is None or tps > best[0]:
                    best = (tps, th, outcome)
    sd = sd_outcome(blocks)
    if best is None or not best[1].active:  # tiers off: viasd is sd (exact, whatever the budget)
        best = (modeled_tokens_per_s(sd, costs), Thresholds(OFF, OFF), sd)
    return Fit(best[1], best[2], best[0], modeled_tokens_per_s(sd, costs))


# ---------------------------------------------------------------------- runs
@dataclass
class RunSummary:
    stats: RunStats
    fidelity: float | None  # token-weighted over prompts; None: not measured


def run_prompts(engine: Engine, hf_model, prompts_ids: list[list[int]], config: GenerationConfig,
                measure_fidelity: bool = True, progress=None, outputs: list | None = None) -> RunSummary:
    total = RunStats(mode=config.mode)
    agree = count = 0
    for ids in prompts_ids:
        engine.reset()
        gen = engine.generate(ids, config)
        total.merge(gen.stats)
        if outputs is not None:
            outputs.append(ids + gen.tokens)
        if measure_fidelity and gen.tokens:
            f = fidelity(hf_model, ids, gen.tokens)
            agree += f * len(gen.tokens)
            count += len(gen.tokens)
        if progress:
            progress()
    total.fidelity = agree / count if count else None  # None: not measured (or no token)
    return RunSummary(total, total.fidelity)


def collect_blocks(engine: Engine, prompts_ids: list[list[int]], config: GenerationConfig, progress=None) -> list[list[BlockRecord]]:
    """Run exact sd with the slim verifier recording; one list of BlockRecords per prompt."""
    per_prompt = []
    for ids in prompts_ids:
        engine.reset()
        recorder = BlockRecorder()
        engine.observers.append(recorder)
        try:
            engine.generate(ids, GenerationConfig(mode="sd", max_new_tokens=config.max_new_tokens, gamma=config.gamma,
                                                  adaptive=config.adaptive, gamma_max=config.gamma_max))
            per_prompt.append(recorder.blocks)
        finally:
            engine.observers.remove(recorder)
        if progress:
            progress()
    return per_prompt


# ---------------------------------------------------------------------- slim views
SLIM_FORMAT_CHOICES = "auto, target, or a comma-separated list of int8, int4"


def parse_slim_formats(text: str, target_quant: str | None = None) -> tuple[str, ...]:
    """--slim-formats: the weight formats whose packed twins calibration tries besides the target's
    own weights. `auto`: every format below the target's precision (slim_view.lower_formats);
    `target`: none. Formats must be below the target's (checked once `target_quant` is known)."""
    text = (text or "auto").strip().lower()
    if text == "target":
        return ()
    if text == "auto":
        return lower_formats(target_quant) if target_quant is not None else ()
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise UsageError(f"unknown --slim-formats '{text}': use {SLIM_FORMAT_CHOICES}")
    if target_quant is not None:
        allowed = lower_formats(target_quant)
        for n in names:
            if n not in allowed:
                why = ("torchao is not installed (pip install 'viasd[quant]')" if not lower_formats()
                       else f"it is not below the target's precision (--quant {target_quant})")
                raise UsageError(f"--slim-formats {n}: {why}; use {', '.join(allowed) or 'target'}")
    return names


def slim_candidates(mask: list[int], n_layers: int, formats: tuple[str, ...]) -> list[SlimView]:
    """The views calibration measures: the layer mask on the target's weights, then for each lower
    format every layer and the mask on its twin (duplicates dropped, the cheapest in memory first)."""
    everything = tuple(range(n_layers))
    views = [SlimView(tuple(mask))]
    for fmt in formats:
        views += [SlimView(everything, fmt), SlimView(tuple(mask), fmt)]
    return list(dict.fromkeys(views))


@dataclass
class Candidate:
    view: SlimView
    agreement: float | None = None  # teacher-forced top-1 agreement with the target (search text)
    kl: float | None = None
    costs: dict = field(default_factory=dict)  # its slim pass costs (slim, slim_1), seconds
    extra_bytes: int | None = None  # memory its weights add to the target's (its twin; 0 on the target's)
    fit: Fit | None = None
    skipped: str | None = None  # why it was not measured

    @property
    def speedup(self) -> float | None:
        """Modeled viasd / sd throughput on the blocks it recorded; None: not measured."""
        if self.fit is None or self.fit.sd_modeled_tokens_per_s <= 0:
            return None
        return self.fit.modeled_tokens_per_s / self.fit.sd_modeled_tokens_per_s

    def to_json(self) -> dict:
        fit = self.fit
        return {"layer_ids": list(self.view.layer_ids), "weights": self.view.weights, "agreement": self.agreement,
                "kl": self.kl, "costs": self.costs, "extra_bytes": self.extra_bytes, "skipped": self.skipped,
                "theta_accept": fit.thresholds.accept if fit else None, "theta_slim": fit.thresholds.slim if fit else None,
                "theta_confidence": fit.thresholds.confidence if fit else None,
                "fit_fidelity": fit.outcome.fidelity if fit else None,
                "modeled_tokens_per_s": fit.modeled_tokens_per_s if fit else None,
                "sd_modeled_tokens_per_s": fit.sd_modeled_tokens_per_s if fit else None, "modeled_speedup": self.speedup}


def choose_candidate(candidates: list[Candidate]) -> Candidate:
    """The measured view with the best modeled speedup over sd; the first measured one (the layer
    mask on the target's weights: no extra memory) when none beats sd, i.e. every fit left the
    tiers off."""
    measured = [c for c in candidates if c.fit is not None]
    if not measured:
        raise ViasdError("no slim view could be measured: " + "; ".join(f"{c.view.weights}: {c.skipped}" for c in candidates))
    best = max(measured, key=lambda c: (c.speedup or 0.0, -measured.index(c)))
    return best if best.fit.thresholds.active else measured[0]


# ---------------------------------------------------------------------- the whole calibration
@dataclass
class CalibrationReport:
    profile: "object"
    saved_to: str | None
    met_budget: bool
    search: MaskSearch
    fit: Fit
    heldout_viasd: RunSummary
    heldout_sd: RunSummary
    costs: dict
    n_fit: int
    n_heldout: int
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None


def run_calibration(opts, prompts, budget: float = DEFAULT_BUDGET, skip_ratio: float = DEFAULT_SKIP_RATIO,
                    max_new_tokens: int = 96, gamma: int = 5, force: bool = False, profile_path=None,
                    slim_formats: str = "auto", log=lambda msg: None, progress=None) -> CalibrationReport:
    """The full calibration of one pair (see the module docstring). `progress(label, total)`
    returns a callable advancing a progress bar (or None)."""
    import datetime

    from viasd_core.loading.profile import Profile, save_profile
    from viasd_core.loading.prompts import encode
    from viasd_core.session import build_session

    check_budget(budget)
    check_skip_ratio(skip_ratio)
    parse_slim_formats(slim_formats)  # the spelling, before any model loads
    if len(prompts) < 2:
        raise UsageError("calibration needs at least 2 prompts (half to fit, half to validate)")
    session = build_session(opts, mode="sd", progress=log, need_profile=False)
    formats = parse_slim_formats(slim_formats, session.target.format)
    engine = session.engine
    if engine.drafter is None:
        raise UsageError("calibration needs a draft: pass --draft (a model or 'ngram')")
    hf_model = session.target.model
    ids = [encode(session.tokenizer, p.text) for p in prompts]
    fit_ids, heldout_ids = ids[0::2], ids[1::2]
    config = GenerationConfig(mode="sd", max_new_tokens=max_new_tokens, gamma=gamma)
    bar = progress or (lambda label, total: None)

    # 1. exact generations on the fit prompts: the calibration text for the mask search
    texts: list[list[int]] = []
    run_prompts(engine, hf_model, fit_ids, config, measure_fidelity=False, outputs=texts,
                progress=bar("generating calibration text", len(fit_ids)))
    search_text = [t[-256:] for t in texts[:8]]
    # 2. layer-mask search
    evaluator = MaskEvaluator(hf_model, search_text)
    n_layers = evaluator.n_layers
    k = int(round(skip_ratio * n_layers))
    n_evals = (n_layers - 2) + 2 * 9 + 6 if k else 1
    search = search_layer_mask(evaluator, skip_ratio, progress=bar("searching the layer mask", n_evals))
    log(f"layer mask: {len(search.best.layer_ids)}/{n_layers} layers, top-1 agreement "
        f"{search.best.agreement:.3f} (best of 6 random masks: {search.random_best.agreement if search.random_best else float('nan'):.3f})")
    # 3. every candidate view: agreement, pass costs, gate records on the fit half, thresholds
    draft_fast = next(iter(engine.drafter.fast_models()), None)
    base_costs = measure_costs(engine.target, draft_fast, block=gamma + 1)
    views = slim_candidates(search.best.layer_ids, n_layers, formats)
    candidates: list[Candidate] = []
    for i, view in enumerate(views):
        cand = Candidate(view)
        candidates.append(cand)
        try:
            slim = slim_verifier(engine.target, view)  # masked like the target: viasd emits its tokens
        except ViasdError as e:  # its twin does not fit in memory: the others are still tried
            cand.skipped = e.message
            log(f"slim view {view.describe(n_layers)}: skipped ({e.message})")
            continue
        cand.extra_bytes = twin_bytes(hf_model, view.weights)
        cand.agreement, cand.kl = evaluator.compare(slim)
        cand.costs = pass_costs(slim, "slim", gamma + 1)
        engine.slim = slim
        label = f"recording gates: {view.describe(n_layers)}"
        blocks = [b for per in collect_blocks(engine, fit_ids, config, progress=bar(label, len(fit_ids))) for b in per]
        cand.fit = fit_thresholds(blocks, {**base_costs, **cand.costs}, budget)
        log(f"slim view {view.describe(n_layers)} (+{cand.extra_bytes / 2**20:.0f} MiB): agreement {cand.agreement:.3f}, "
            f"pass {cand.costs['slim'] * 1e3:.1f} ms "
            f"vs target {base_costs['target'] * 1e3:.1f} ms ({cand.costs['slim'] / base_costs['target']:.2f}), "
            "modeled " + (f"{cand.speedup:.2f}x sd" if cand.speedup is not None else "speed not measured (nothing replayed)")
            + ("" if cand.fit.thresholds.active else " (tiers off)"))
        keep = {v.weights for v in views[i + 1 : i + 2]}
        if any(c.fit is not None for c in candidates):
            keep.add(choose_candidate(candidates).view.weights)
        release_twins(hf_model, keep=keep)  # at most two twins at once: the best so far and the next
    chosen = choose_candidate(candidates)
    release_twins(hf_model, keep={chosen.view.weights})
    engine.slim = slim_verifier(engine.target, chosen.view)
    fit, costs = chosen.fit, {**base_costs, **chosen.costs}
    log(f"chosen slim view: {chosen.view.describe(n_layers)}")
    # 4. validation on the held-out half: real viasd runs against real sd runs
    vconf = GenerationConfig(mode="viasd", max_new_tokens=max_new_tokens, gamma=gamma, thresholds=fit.thresholds)
    heldout_viasd = run_prompts(engine, hf_model, heldout_ids, vconf, progress=bar("validating viasd (held-out)", len(heldout_ids)))
    heldout_sd = run_prompts(engine, hf_model, heldout_ids, config, measure_fidelity=False,
                             progress=bar("timing sd (held-out)", len(heldout_ids)))
    # heldout_sd.fidelity stays None: sd is exact by construction (tested), not re-measured here
    met = heldout_viasd.fidelity is not None and heldout_viasd.fidelity >= 1 - budget
    profile = Profile(
        target_id=session.target.model_id, draft_id=session.draft_id, quant=session.options.quant,
        device=engine.device.type, dtype=str(engine.target.dtype).replace("torch.", ""),
        layer_ids=list(chosen.view.layer_ids), n_layers=n_layers, slim_weights=chosen.view.weights,
        theta_accept=fit.thresholds.accept, theta_slim=fit.thresholds.slim,
        theta_confidence=fit.thresholds.confidence, budget=budget,
        heldout_fidelity=heldout_viasd.fidelity, fit_fidelity=fit.outcome.fidelity,
        target_revision=session.target.revision,
        draft_revision=session.draft.revision if session.draft is not None else None,
        slim_agreement=chosen.agreement, costs=costs, modeled_tokens_per_s=fit.modeled_tokens_per_s,
        measured={"viasd": heldout_viasd.stats.to_dict(), "sd_tokens_per_s": heldout_sd.stats.tokens_per_s,
                  "n_fit_prompts": len(fit_ids), "n_heldout_prompts": len(heldout_ids),
                  "max_new_tokens": max_new_tokens, "gamma": gamma},
        candidates=[c.to_json() for c in candidates],
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    saved = None
    if met or force:
        saved = str(save_profile(profile, profile_path))
    report = CalibrationReport(profile, saved, met, search, fit, heldout_viasd, heldout_sd, costs, len(fit_ids),
                               len(heldout_ids), candidates, chosen)
    if not met and not force:
        raise CalibrationMissed(report)
    return report


class CalibrationMissed(Exception):
    def __init__(self, report: CalibrationReport):
        p = report.profile
        super().__init__(
            f"held-out fidelity {format_fidelity(p.heldout_fidelity)} misses the budget (needs >= {1 - p.budget:.4f}); "
            "profile not saved: calibrate on more prompts (--prompts, --limit), raise --budget, or pass --force"
        )
        self.report = report
