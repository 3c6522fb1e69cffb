"""`viasd calibrate`: find the slim verifier's layer mask, then fit the tier thresholds to a budget.

docs/algorithm.md sections 4 and 5:
  1. generate (exact sd) on the calibration prompts; the finished sequences are calibration text
  2. search the layer mask that keeps the slim verifier closest to the target on that text
  3. re-run with the slim verifier recording, per drafted token, the gate and whether the
     target agrees (teacher-forced labels from the verification pass)
  4. fit thresholds on half of the prompts: the highest modeled throughput (tier costs measured
     on this machine) with fidelity >= 1 - budget
  5. validate on the other half with real viasd runs and a teacher-forced fidelity pass; a
     profile that misses the budget there is not saved (unless forced)
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from .engine import Engine, GenerationConfig
from .errors import UsageError
from .fidelity import fidelity
from .model import FastModel
from .router import OFF, BlockRecord, ReplayOutcome, Thresholds, replay
from .stats import RunStats, format_fidelity

DEFAULT_BUDGET = 0.01
DEFAULT_SKIP_RATIO = 0.45


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
        agree = total = 0
        kl_sum = 0.0
        for seq, t_logp, t_arg in zip(self.sequences, self.target_logp, self.target_argmax):
            s_logp = self._logits(slim, seq).log_softmax(-1)
            agree += int((s_logp.argmax(-1) == t_arg).sum())
            total += seq.shape[0]
            kl_sum += float((t_logp.exp() * (t_logp - s_logp)).sum())
        return MaskScore(sorted(layer_ids), agree / total, kl_sum / total)


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
def measure_costs(target: FastModel, slim: FastModel, draft: FastModel | None, context: int = 256,
                  block: int = 6, repeats: int = 7) -> dict:
    """Median seconds of one pass: target and slim over `block` tokens, one draft token."""
    device = target.device
    ids = torch.randint(10, min(1000, target.shape.vocab_size), (context + block,), device=device)

    def timed(model: FastModel, n: int) -> float:
        model.allocate(context + block + 1)
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

    costs = {"target": timed(target, block), "slim": timed(slim, block), "target_1": timed(target, 1)}
    costs["draft"] = timed(draft, 1) if draft is not None else 0.0
    return costs


def modeled_tokens_per_s(outcome: ReplayOutcome, costs: dict) -> float:
    seconds = (outcome.drafted * costs["draft"] + outcome.slim_passes * costs["slim"]
               + outcome.target_passes * costs["target"])
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


def fit_thresholds(blocks: list[BlockRecord], costs: dict, budget: float, grid: int = 24) -> Fit:
    """Grid search over (theta_accept, theta_slim) maximizing modeled tokens/s subject to
    replayed fidelity >= 1 - budget. A threshold of OFF (> 1) disables its tier. Without any
    recorded token nothing can be shown to meet the budget: both tiers stay off (viasd is sd)."""
    gates = sorted(g for b in blocks for g in b.gate)
    if gates:
        qs = [gates[min(len(gates) - 1, int(q * (len(gates) - 1)))] for q in [i / grid for i in range(grid + 1)]]
    else:
        qs = []
    values = sorted(set([OFF, 1.0, 0.0] + qs))
    best = None
    for accept in values:
        for slim in values:
            if slim > accept:
                continue
            th = Thresholds(accept, slim)
            outcome = replay(blocks, th)
            if outcome.fidelity is None or outcome.fidelity < 1 - budget:
                continue
            tps = modeled_tokens_per_s(outcome, costs)
            if best is None or tps > best[0]:
                best = (tps, th, outcome)
    if best is None:  # no recorded token (all-off is exact and meets any budget otherwise)
        th = Thresholds(OFF, OFF)
        outcome = replay(blocks, th)
        best = (modeled_tokens_per_s(outcome, costs), th, outcome)
    return Fit(best[1], best[2], best[0], modeled_tokens_per_s(sd_outcome(blocks), costs))


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
        engine.recorder = []
        try:
            engine.generate(ids, GenerationConfig(mode="sd", max_new_tokens=config.max_new_tokens, gamma=config.gamma,
                                                  adaptive=config.adaptive, gamma_max=config.gamma_max))
            per_prompt.append(engine.recorder)
        finally:
            engine.recorder = None
        if progress:
            progress()
    return per_prompt


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


def run_calibration(opts, prompts, budget: float = DEFAULT_BUDGET, skip_ratio: float = DEFAULT_SKIP_RATIO,
                    max_new_tokens: int = 96, gamma: int = 5, force: bool = False, profile_path=None,
                    log=lambda msg: None, progress=None) -> CalibrationReport:
    """The full calibration of one pair (see the module docstring). `progress(label, total)`
    returns a callable advancing a progress bar (or None)."""
    import datetime

    from .profile import Profile, save_profile
    from .prompts import encode
    from .session import build_session, slim_verifier

    check_budget(budget)
    check_skip_ratio(skip_ratio)
    if len(prompts) < 2:
        raise UsageError("calibration needs at least 2 prompts (half to fit, half to validate)")
    session = build_session(opts, mode="sd", progress=log, need_profile=False)
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
    k = int(round(skip_ratio * evaluator.n_layers))
    n_evals = (evaluator.n_layers - 2) + 2 * 9 + 6 if k else 1
    search = search_layer_mask(evaluator, skip_ratio, progress=bar("searching the layer mask", n_evals))
    log(f"slim verifier: {len(search.best.layer_ids)}/{evaluator.n_layers} layers, top-1 agreement "
        f"{search.best.agreement:.3f} (best of 6 random masks: {search.random_best.agreement if search.random_best else float('nan'):.3f})")
    slim = slim_verifier(engine.target, search.best.layer_ids)  # masked like the target: viasd emits its tokens
    engine.slim = slim
    # 3. gate features and labels on the fit half
    blocks = [b for per in collect_blocks(engine, fit_ids, config, progress=bar("recording gate features", len(fit_ids))) for b in per]
    # 4. costs on this machine, then the threshold fit
    draft_fast = getattr(engine.drafter, "model", None)
    costs = measure_costs(engine.target, slim, draft_fast, block=gamma + 1)
    fit = fit_thresholds(blocks, costs, budget)
    # 5. validation on the held-out half: real viasd runs against real sd runs
    vconf = GenerationConfig(mode="viasd", max_new_tokens=max_new_tokens, gamma=gamma, thresholds=fit.thresholds)
    heldout_viasd = run_prompts(engine, hf_model, heldout_ids, vconf, progress=bar("validating viasd (held-out)", len(heldout_ids)))
    heldout_sd = run_prompts(engine, hf_model, heldout_ids, config, measure_fidelity=False,
                             progress=bar("timing sd (held-out)", len(heldout_ids)))
    # heldout_sd.fidelity stays None: sd is exact by construction (tested), not re-measured here
    met = heldout_viasd.fidelity is not None and heldout_viasd.fidelity >= 1 - budget
    profile = Profile(
        target_id=session.target.model_id, draft_id=session.draft_id, quant=session.options.quant,
        device=engine.device.type, dtype=str(engine.target.dtype).replace("torch.", ""),
        layer_ids=search.best.layer_ids, n_layers=evaluator.n_layers,
        theta_accept=fit.thresholds.accept, theta_slim=fit.thresholds.slim, budget=budget,
        heldout_fidelity=heldout_viasd.fidelity, fit_fidelity=fit.outcome.fidelity,
        target_revision=session.target.revision,
        draft_revision=session.draft.revision if session.draft is not None else None,
        slim_agreement=search.best.agreement, costs=costs, modeled_tokens_per_s=fit.modeled_tokens_per_s,
        measured={"viasd": heldout_viasd.stats.to_dict(), "sd_tokens_per_s": heldout_sd.stats.tokens_per_s,
                  "n_fit_prompts": len(fit_ids), "n_heldout_prompts": len(heldout_ids),
                  "max_new_tokens": max_new_tokens, "gamma": gamma},
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    saved = None
    if met or force:
        saved = str(save_profile(profile, profile_path))
    report = CalibrationReport(profile, saved, met, search, fit, heldout_viasd, heldout_sd, costs, len(fit_ids), len(heldout_ids))
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
