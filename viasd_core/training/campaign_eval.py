"""Stage 7 of the campaign: each head measured on prompts no stage trained on, and the ship rule.

Two figures per head, on the evaluation prompts (the 26-prompt dev set; the prompt stage drops
everything near them, and they are never answered for training):

- first-position agreement (and positions 2-8), teacher-forced on the target's greedy answers: the
  same measure as `viasd distill --kind feature` (192 new tokens, prompts cut to their last 384
  tokens), so the shipped head scores what docs/distill.md reports;
- tau, tokens per target pass of `sd` (greedy, 128 new tokens, context 1024): the head alone in
  blocks of a fixed 4 drafts (no policy: a figure of the head only, the same on any machine), and the
  default `sd` (the head plus prompt lookup, the adaptive policy, as `viasd bench` runs it). On a CPU
  the default policy's plain-step choices follow measured wall times, so its tau moves with the
  machine's load: every head of a comparison is measured in one loop, prompt by prompt, in turn.

Every figure is measured with the target at the campaign's weight format (`CampaignConfig.quant`),
the one the heads draft for: the answers and their features teacher-forced, and the `sd` sessions'
target (float32 for `none`, as the first campaigns measured; int8 or int4 as `viasd generate --quant`
runs it). The deterministic figures of each head are written once (`eval/<name>.json`, with the
format they were measured at), so a killed run measures only what is missing; the default tau is
measured again at each evaluation. `ship` replaces the shipped head with the best candidate only
when it beats it (`better`), the shipped head measured at the same format.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from viasd_core import paths
from viasd_core.speculation.eagle_files import load_feature_head
from viasd_core.speculation.stats import RunStats
from viasd_core.loading.models import Loaded, load_model
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.prompts import encode, load_prompts
from viasd_core.runtime.weight_format import NONE, WeightFormat
from viasd_core.session import GenerationRequest, build_session, resolve_config
from viasd_core.training import eagle_data, eagle_ttt
from viasd_core.training.teacher_answers import build_dataset


@dataclass
class EvalConfig:
    prompts: Optional[Path] = None  # the evaluation prompts (docs/results/cpu-prompts.jsonl)
    answer_tokens: int = 192
    tau_tokens: int = 128
    max_context: int = 1024
    positions: int = 8  # draft positions whose agreement is reported
    fixed_gamma: int = 4  # the head alone, blocks of this many drafts


def target_dtype(fmt: WeightFormat) -> Optional[str]:
    """The target's dtype at the weight format `fmt`: float32 for `none` (the float32 campaign), the
    format's own activations otherwise (None: what `--quant int4` picks, bfloat16 on a CPU)."""
    return "float32" if fmt == NONE else None


def load_target(ref: str, fmt: WeightFormat) -> Loaded:
    """The target at the campaign's weight format, as the answer and feature stages and the
    evaluation use it."""
    return load_model(ref, dtype=target_dtype(fmt), quant=fmt)


def records_file(work: Path, fmt: WeightFormat) -> Path:
    """Where the evaluation records made at `fmt` are cached: `eval/features.pt` for the float32
    target (the name the first campaigns' work folders hold), `eval/features-<format>.pt` for
    another, so records of one format are never read as another's."""
    return work / "eval" / ("features.pt" if fmt == NONE else f"features-{fmt.name}.pt")


def eval_records(target: Loaded, layers, config: EvalConfig, work: Path) -> list[eagle_data.FeatureRecord]:
    """The target's greedy answers to the evaluation prompts, teacher-forced, both made by `target` in
    its weight format (cached in `work/eval`, per format: records_file)."""
    path = records_file(work, target.format)
    if path.exists():
        return eagle_data.load_records(path)
    prompts = load_prompts(config.prompts)
    recs = build_dataset(target, [p.text for p in prompts], config.answer_tokens, batch_size=32,
                         categories=[p.category for p in prompts])
    feats = eagle_data.teacher_pass(target.model, [(r.input_ids.tolist(), r.prompt_len, r.category) for r in recs], layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    eagle_data.save_records(feats, path)
    return feats


def head_session(target_ref: str, head: Path | str, max_context: int, hybrid: bool = False, fmt: WeightFormat = NONE):
    """A session for `sd` with `head` as the draft (with prompt lookup beside it when `hybrid`), the
    target at the weight format `fmt` (float32 for `none`), eager: what `viasd generate --mode sd -d
    HEAD --quant FMT` builds."""
    draft = f"{head}+ngram" if hybrid else str(head)
    return build_session(ModelOptions(model=target_ref, draft=draft, dtype=target_dtype(fmt), quant=fmt.name,
                                      max_context=max_context, compile="off"), mode="sd")


def _run_sd(session, prompts, config: EvalConfig, asked: GenerationRequest, total: RunStats) -> None:
    """Run `asked` (resolved on the session: session.resolve_config) on each prompt, adding up the stats."""
    gen = resolve_config(session, asked)
    for p in prompts:
        ids = encode(session.tokenizer, p.text)[-(config.max_context - config.tau_tokens - 1) :]
        session.engine.reset()
        total.merge(session.engine.generate(ids, gen).stats)


def _tau_figures(total: RunStats) -> dict:
    return {"tau": total.mean_accepted_length, "new_tokens": total.new_tokens, "target_passes": total.target_passes,
            "acceptance_by_position": total.acceptance_by_position[:8]}


def tau_fixed(target_ref: str, head: Path, config: EvalConfig, fmt: WeightFormat) -> dict:
    """Tokens per target pass of greedy `sd` with `head` alone over the evaluation prompts, in blocks
    of `config.fixed_gamma` drafts (no policy: a figure of the head alone, machine-independent), the
    target at `fmt`."""
    session = head_session(target_ref, head, config.max_context, fmt=fmt)
    total = RunStats(mode="sd")
    asked = GenerationRequest(mode="sd", max_new_tokens=config.tau_tokens, gamma=config.fixed_gamma, adaptive=False,
                              trees=False)
    _run_sd(session, load_prompts(config.prompts), config, asked, total)
    return _tau_figures(total)


def tau_default(target_ref: str, heads: dict[str, Path], config: EvalConfig, fmt: WeightFormat) -> dict[str, dict]:
    """Tokens per target pass of the default `sd` (each head plus prompt lookup, the adaptive policy)
    over the evaluation prompts, the target at `fmt`, for every head in one loop: prompt by prompt, the
    heads in turn (the first one rotating), so that a change in the machine's load while measuring
    reaches every head alike. The policy's plain steps follow wall times, which is why the heads are
    not measured one after the other."""
    sessions = {name: head_session(target_ref, folder, config.max_context, hybrid=True, fmt=fmt)
                for name, folder in heads.items()}
    totals = {name: RunStats(mode="sd") for name in heads}
    # chains from GenerationConfig's first block, no --tree auto probe: what earlier evaluations measured
    asked = GenerationRequest(mode="sd", max_new_tokens=config.tau_tokens, trees=False, measured_start=False)
    names = list(heads)
    for k, p in enumerate(load_prompts(config.prompts)):
        for name in names[k % len(names):] + names[: k % len(names)]:
            _run_sd(sessions[name], [p], config, asked, totals[name])
    return {name: _tau_figures(totals[name]) for name in names}


# What the cached figures were measured with; a change that moves them (the default tau follows the
# verify passes' measured cost) bumps it, so every head of a comparison is measured alike.
# 2: float32 verify passes through the packed short products (runtime/short_products.py).
# 3: the cache holds the deterministic figures only; the default tau is measured at each evaluation,
#    every head in one interleaved loop (tau_default).
MEASURED_WITH = 3


def measure(name: str, head: Path, target: Loaded, target_ref: str, records, config: EvalConfig, work: Path,
            log: Callable[[str], None]) -> dict:
    """Agreement and fixed-block tau of the head in folder `head`, with `target` at its weight format
    (the records made by it: eval_records; the head reads its input embedding, as in an `sd`
    session). Cached in `work/eval/<name>.json`, for these weights, MEASURED_WITH and the target's
    format only: once a head ships, "shipped" names other weights and is measured again; a figure
    of another format is measured again (a file without the format was measured on the float32
    target, before the format was recorded)."""
    path = work / "eval" / f"{name}.json"
    weights = hashlib.sha256((head / "model.safetensors").read_bytes()).hexdigest()
    fmt = target.format
    if path.exists():
        cached = json.loads(path.read_text())
        if (cached.get("weights_sha256") == weights and cached.get("measured_with") == MEASURED_WITH
                and cached.get("target_format", NONE.name) == fmt.name):
            return cached
    model = target.model
    h = load_feature_head(head, model.config, embed=model.get_input_embeddings(), dtype=torch.float32)
    scores = eagle_ttt.evaluate_head(h, records, steps=config.positions)
    by_cat = {c: eagle_ttt.evaluate_head(h, [r for r in records if r.category == c])["agreement"][0]
              for c in sorted({r.category for r in records})}
    result = {"head": name, "weights_sha256": weights, "measured_with": MEASURED_WITH, "target_format": fmt.name,
              "agreement": scores["agreement"], "tokens": scores["tokens"], "first_by_category": by_cat,
              "tau_fixed": tau_fixed(target_ref, head, config, fmt)}
    paths.atomic_write_json(path, result)
    log(f"eval {name}: first-position agreement {scores['agreement'][0]:.3f}, "
        f"tau of the head alone ({config.fixed_gamma} drafts a block) {result['tau_fixed']['tau']:.3f}")
    return result


DEFAULT_TAU_SLACK = 0.02  # how far below the shipped head's default-draft tau a candidate may land


def better(candidate: dict, shipped: dict) -> bool:
    """The ship rule: a higher first-position agreement and a higher tau of the head alone (blocks of
    a fixed length: the same on any machine), and a default-draft tau at most 2% below the shipped
    head's. The default policy's plain steps follow this machine's wall times (on a CPU it drafts
    only where a block pays), so that tau measures the machine as much as the head."""
    return (candidate["agreement"][0] > shipped["agreement"][0]
            and candidate["tau_fixed"]["tau"] > shipped["tau_fixed"]["tau"]
            and candidate["tau_default"]["tau"] >= (1 - DEFAULT_TAU_SLACK) * shipped["tau_default"]["tau"])


def ship(folder: Path, to: Path) -> None:
    """Copy the head folder over `to` atomically (a temporary folder beside it, then renames)."""
    with paths.atomic_folder(to) as tmp:
        for f in folder.iterdir():
            shutil.copy2(f, tmp / f.name)
