"""`viasd calibrate`: choose the slim view, then fit the tier thresholds to a budget.

docs/algorithm.md sections 4 and 5, one step per module of this package:
  1. generate (exact sd) on the calibration prompts; the finished sequences are calibration text
     (runs.py)
  2. search the layer mask that keeps the slim verifier closest to the target on that text
     (mask_search.py)
  3. for every candidate view (the mask on the target's weights; every layer and the mask on an
     int8 / int4 twin of the target: candidates.py): measure its agreement with the target and its
     pass cost (costs.py), re-run sd with it recording, per drafted token, the gate and whether the
     target agrees (teacher-forced labels from the verification pass), and fit its thresholds on
     half of the prompts (fit.py): the highest modeled throughput (pass costs measured on this
     machine) with fidelity >= 1 - budget. Keep the view with the best modeled speedup over sd
  4. validate on the other half with real viasd runs and a teacher-forced fidelity pass; a
     profile that misses the budget there is not saved (unless forced)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from viasd_core.calibration.candidates import Candidate, attach_chosen, measure_candidates, parse_slim_formats, slim_candidates
from viasd_core.calibration.costs import measure_costs
from viasd_core.calibration.fit import Fit
from viasd_core.calibration.mask_search import MaskEvaluator, MaskSearch, search_layer_mask
from viasd_core.calibration.runs import RunSummary, run_prompts
from viasd_core.speculation.stats import format_fidelity
from viasd_core import paths
from viasd_core.errors import UsageError, ViasdError

DEFAULT_BUDGET = 0.01
DEFAULT_SKIP_RATIO = 0.45


def check_budget(budget: float) -> None:
    if not 0 < budget < 1:
        extra = " (a budget of 0 allows no loss at all: use --mode exact or sd, which are lossless)" if budget == 0 else ""
        raise UsageError(f"--budget must be in (0, 1), got {budget}{extra}")


def check_skip_ratio(ratio: float) -> None:
    if not 0 <= ratio <= 0.9:
        raise UsageError(f"--skip-ratio must be in [0, 0.9], got {ratio}")


def check_profile_path(path: str | Path | None) -> None:
    """The file the profile will be written to must be writable: checked before anything runs (a
    calibration takes minutes; its result must not be lost at the end). None: the config
    directory's profiles folder (the file's name needs the loaded models; the folder is checked)."""
    if path is None:
        paths.check_writable_dir(paths.config_dir() / "profiles", "the profiles folder")
    else:
        paths.check_writable_file(path, "--profile", noun="profile file")


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
    """The full calibration of one pair (see the module docstring), with the model options `opts`
    (a session.ModelOptions: --max-context and --compile apply to every run). The profile is written
    (atomically) to `profile_path`, else to `opts.profile`, else to the config directory where
    generate, chat and bench find it. `progress(label, total)` returns a callable advancing a
    progress bar (or None)."""
    from viasd_core.loading.prompts import encode
    from viasd_core.session import GenerationRequest, build_session, resolve_config

    profile_path = profile_path if profile_path is not None else opts.profile
    check_budget(budget)
    check_skip_ratio(skip_ratio)
    check_profile_path(profile_path)
    parse_slim_formats(slim_formats)  # the spelling, before any model loads
    if len(prompts) < 2:
        raise UsageError("calibration needs at least 2 prompts (half to fit, half to validate)")
    session = build_session(opts, mode="sd", progress=log, need_profile=False)
    formats = parse_slim_formats(slim_formats, session.target.format, session.engine.device)
    engine = session.engine
    if engine.drafter is None:
        raise UsageError("calibration needs a draft: pass --draft (a model or 'ngram')")
    hf_model = session.target.model
    ids = [encode(session.tokenizer, p.text) for p in prompts]
    fit_ids, heldout_ids = ids[0::2], ids[1::2]
    asked = GenerationRequest(mode="sd", max_new_tokens=max_new_tokens, gamma=gamma, trees=False)  # chains, -g's blocks
    config = resolve_config(session, asked)
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
    base_costs = measure_costs(engine.target, next(iter(engine.drafter.fast_models()), None), block=gamma + 1)
    views = slim_candidates(search.best.layer_ids, n_layers, formats)
    candidates = measure_candidates(engine, evaluator, views, fit_ids, config, base_costs, budget, log=log, bar=bar)
    chosen = attach_chosen(engine, candidates)
    fit, costs = chosen.fit, {**base_costs, **chosen.costs}
    log(f"chosen slim view: {chosen.view.describe(n_layers)}")
    # 4. validation on the held-out half: real viasd runs against real sd runs
    vconf = resolve_config(session, dataclasses.replace(asked, mode="viasd", thresholds=fit.thresholds))
    heldout_viasd = run_prompts(engine, hf_model, heldout_ids, vconf, progress=bar("validating viasd (held-out)", len(heldout_ids)))
    heldout_sd = run_prompts(engine, hf_model, heldout_ids, config, measure_fidelity=False,
                             progress=bar("timing sd (held-out)", len(heldout_ids)))
    # heldout_sd.fidelity stays None: sd is exact by construction (tested), not re-measured here
    met = heldout_viasd.fidelity is not None and heldout_viasd.fidelity >= 1 - budget
    profile = make_profile(session, chosen, candidates, costs, budget, heldout_viasd, heldout_sd,
                           measured_extra={"n_fit_prompts": len(fit_ids), "n_heldout_prompts": len(heldout_ids),
                                           "max_new_tokens": max_new_tokens, "gamma": gamma})
    report = CalibrationReport(profile, None, met, search, fit, heldout_viasd, heldout_sd, costs, len(fit_ids),
                               len(heldout_ids), candidates, chosen)
    if met or force:
        report.saved_to = save_or_fall_back(report, profile_path)
    if not met and not force:
        raise CalibrationMissed(report)
    return report


def make_profile(session, chosen: Candidate, candidates: list[Candidate], costs: dict, budget: float,
                 heldout_viasd: RunSummary, heldout_sd: RunSummary, measured_extra: dict):
    """The loading.profile.Profile of a calibration: the chosen view, its thresholds, and what was
    measured on the held-out prompts."""
    import datetime

    from viasd_core.loading.profile import Profile

    engine, fit = session.engine, chosen.fit
    return Profile(
        target_id=session.target.model_id, draft_id=session.draft_id, quant=session.options.quant,
        device=engine.device.type, dtype=str(engine.target.dtype).replace("torch.", ""),
        layer_ids=list(chosen.view.layer_ids), n_layers=engine.target.shape.n_layers, slim_weights=chosen.view.weights,
        theta_accept=fit.thresholds.accept, theta_slim=fit.thresholds.slim,
        theta_confidence=fit.thresholds.confidence, budget=budget,
        heldout_fidelity=heldout_viasd.fidelity, fit_fidelity=fit.outcome.fidelity,
        target_revision=session.target.revision,
        draft_revision=session.draft.revision if session.draft is not None else None,
        slim_agreement=chosen.agreement, costs=costs, modeled_tokens_per_s=fit.modeled_tokens_per_s,
        measured={"viasd": heldout_viasd.stats.to_dict(), "sd_tokens_per_s": heldout_sd.stats.tokens_per_s,
                  **measured_extra},
        candidates=[c.to_json() for c in candidates],
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def save_or_fall_back(report: CalibrationReport, path: str | Path | None) -> str:
    """Save the report's profile to `path` (None: the config directory); if that fails at this
    point (OSError: the disk filled, the folder vanished), save it in a new folder of the cache,
    else of the current folder (paths.write_elsewhere), and raise ProfileNotSaved naming it."""
    from viasd_core.loading.profile import profile_path as default_path, save_profile

    p = report.profile
    path = Path(path).expanduser() if path is not None else default_path(p.target_id, p.draft_id, p.quant, p.device)
    try:
        return str(save_profile(p, path))
    except OSError as e:
        reason = e.strerror or str(e)
    folder = paths.write_elsewhere(lambda f: save_profile(p, f / path.name), "profile")
    report.saved_to = None if folder is None else str(folder / path.name)
    raise ProfileNotSaved(report, path, reason)


class ProfileNotSaved(ViasdError):
    """The profile could not be written where it belongs at the end of a calibration; `report.saved_to`:
    where it was written instead (None: nowhere; the command prints its JSON on stdout)."""

    def __init__(self, report: CalibrationReport, path: Path, reason: str):
        where = (f"it is in '{report.saved_to}' instead: move it to '{path}' or pass --profile '{report.saved_to}'"
                 if report.saved_to else "nor to the cache or the current folder: its JSON is on stdout")
        super().__init__(f"could not write the profile to '{path}' ({reason}): {where}")
        self.report = report


class CalibrationMissed(Exception):
    def __init__(self, report: CalibrationReport):
        p = report.profile
        super().__init__(
            f"held-out fidelity {format_fidelity(p.heldout_fidelity)} misses the budget (needs >= {1 - p.budget:.4f}); "
            "profile not saved: calibrate on more prompts (--prompts, --limit), raise --budget, or pass --force"
        )
        self.report = report
