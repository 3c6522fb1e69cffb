"""The slim views calibration compares (docs/algorithm.md section 4): the layer mask on the
target's weights, and every layer and the mask on packed twins of the target in lower weight
formats (runtime/slim_view.py). Each is measured (agreement, pass cost, extra memory), its
thresholds fitted on its own recorded blocks; the best modeled speedup over sd is kept."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from viasd_core.calibration.costs import pass_costs
from viasd_core.calibration.fit import Fit, fit_thresholds
from viasd_core.calibration.mask_search import MaskEvaluator
from viasd_core.calibration.runs import collect_blocks
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.slim_view import SlimView, lower_formats, release_twins, slim_verifier, twin_bytes
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import FORMATS
from viasd_core.errors import UsageError, ViasdError


SLIM_FORMAT_CHOICES = "auto, target, or a comma-separated list of int8, int4"


def parse_slim_formats(text: str, target: WeightFormat | None = None, device: torch.device | None = None) -> tuple[str, ...]:
    """--slim-formats: the weight formats whose packed twins calibration tries besides the target's
    own weights. `auto`: every format below the target's precision that runs on `device`
    (slim_view.lower_formats); `target`: none. Formats must be below the target's (checked once
    `target` is known)."""
    text = (text or "auto").strip().lower()
    if text == "target":
        return ()
    if text == "auto":
        return lower_formats(target, device) if target is not None else ()
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise UsageError(f"unknown --slim-formats '{text}': use {SLIM_FORMAT_CHOICES}")
    if target is not None:
        allowed = lower_formats(target, device)
        for n in names:
            if n not in allowed:
                why = ("torchao is not installed (pip install 'viasd[quant]')" if not lower_formats()
                       else f"it is not below the target's precision (--quant {target.name}) or does not run on this device")
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


def measure_candidates(engine: Engine, evaluator: MaskEvaluator, views: list[SlimView], fit_ids: list[list[int]],
                       config: GenerationConfig, base_costs: dict, budget: float, log=lambda msg: None,
                       bar=lambda label, total: None) -> list[Candidate]:
    """Every view in `views`: its agreement with the target (on the evaluator's text), its pass cost,
    its recorded blocks on the fit prompts and its thresholds fitted to `budget`. A view whose twin
    does not fit in memory is skipped with the reason; at most two twins are held at once (the best
    so far and the next)."""
    hf_model, n_layers, block = engine.target.hf_model, evaluator.n_layers, config.gamma + 1
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
        engine.slim = slim  # sized, and compiled and warmed up when the engine is: costs are the run's
        cand.costs = pass_costs(slim, "slim", block)
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
        release_twins(hf_model, keep=keep)
    return candidates


def attach_chosen(engine: Engine, candidates: list[Candidate]) -> Candidate:
    """Choose among the measured candidates (choose_candidate), release every other twin, and make
    the chosen view the engine's slim verifier."""
    chosen = choose_candidate(candidates)
    release_twins(engine.target.hf_model, keep={chosen.view.weights})
    engine.slim = slim_verifier(engine.target, chosen.view)
    return chosen
