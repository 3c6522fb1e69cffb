"""The training campaign of an EAGLE-3 head: ten times the data, made by the target, then its own mistakes.

Stages, in order; each one resumes after a kill at any point (its progress is in files written
atomically) and is skipped once done:

    prompts     the target writes prompts; near-duplicates and anything near an evaluation prompt go
                (campaign_prompts)                                              data/prompts.jsonl
    answers     the target's greedy and sampled answers, token ids in shards   data/answers/*.npz
    features    one teacher pass per shard: features and top-k soft labels     work/features/*
    train       a head trained on the training prompts' sequences              work/heads/data
    on_policy   greedy `sd` with that head over the training prompts' greedy    work/on_policy/*.npz
                answers, simulated on their features (on_policy): where its
                drafts were rejected; then a fine-tune weighted there           work/heads/on_policy
    eval        agreement and tau of the shipped and the new heads on the evaluation prompts, and the
                ship rule (campaign_eval)                                       data/eval-report.json

`data` is committed (prompts and token ids are costly to make: hours of generation on a CPU);
`work` is not (features take gigabytes; checkpoints and heads are rebuilt from `data`). Prompts with
index % held_out_every == 0 are held out: never trained on, their greedy answers pick the best weights.

The target's weight format (`quant`: none, int8 or int4) is the one the head will draft for: the
answers and features (and so the on-policy rejections, simulated on them) come from the target in
that format, and the evaluation measures the heads on it. `none` is the float32 target, the first
campaign's. Another format is recorded in `data/campaign.json` and `work/campaign.json`, which may
also name another campaign's prompts (`prompts_from`: the file by path from the data folder, the
number of prompts used and a checksum of their lines) instead of writing new ones; a run that asks
for another format than its folders hold is refused. A folder without the record holds a float32
campaign (made before the record).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from viasd_core import paths
from viasd_core.runtime.weight_format import NONE, WeightFormat
from viasd_core.speculation.eagle_files import load_feature_head
from viasd_core.errors import UsageError
from viasd_core.loading.prompts import load_prompts
from viasd_core.training import campaign_store as store
from viasd_core.training.campaign_answers import SPLITS, AnswerConfig, answer_shards, run_answer_stage
from viasd_core.training.campaign_eval import EvalConfig, better, eval_records, load_target, measure, ship, tau_default
from viasd_core.training.campaign_features import CampaignRecords, run_feature_stage
from viasd_core.training.campaign_prompts import PROMPTS, PromptConfig, raw_shards, run_prompt_stage
from viasd_core.training.campaign_train import TrainConfig, rejection_focus, train_on_data, train_on_policy
from viasd_core.training.eagle_data import default_feature_layers
from viasd_core.training.on_policy import OnPolicyConfig, run_on_policy_stage

STAGES = ("prompts", "answers", "features", "train", "on_policy", "eval")


@dataclass
class CampaignConfig:
    target: str
    data: Path
    work: Path
    prompts: PromptConfig = field(default_factory=PromptConfig)
    answers: AnswerConfig = field(default_factory=AnswerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    on_policy_boost: float = 4.0  # extra loss weight where the head's draft was rejected
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    held_out_every: int = 20
    teacher_batch_size: int = 8
    threads: int = 1
    on_policy_stage: bool = True  # False: evaluate the data head alone (the fine-tune is left for a later run)
    ship_to: Optional[Path] = None  # the shipped head: measured, and replaced only by a better one
    quant: str = "none"  # the target's weight format for answers and features: none (float32), int8, int4
    prompts_from: Optional[Path] = None  # another campaign's prompts.jsonl, used instead of a prompt stage

    def held_out(self, prompt_index: int) -> bool:
        return prompt_index % self.held_out_every == 0


def run_campaign(config: CampaignConfig, until: Optional[str] = None, log: Callable[[str], None] = lambda m: None) -> dict:
    """Run (or resume) the stages up to `until` (all by default). Returns the evaluation report when it ran."""
    if until is not None and until not in STAGES:
        raise UsageError(f"unknown stage '{until}': use one of {', '.join(STAGES)}")
    stop = STAGES.index(until) if until else len(STAGES) - 1
    fmt = WeightFormat.parse(config.quant)
    torch.set_num_threads(config.threads)
    data, work = Path(config.data), Path(config.work)
    source = check_record(config)
    target = load_target(config.target, fmt)
    layers = default_feature_layers(target.model.config.num_hidden_layers)
    if source is None:
        prompts_file = run_prompt_stage(target, data, config.prompts, log)
        prompts = load_prompts(prompts_file)
    else:
        log(f"prompts: {source[1]} prompts of {source[0]} (campaign.json)")
        prompts = load_prompts(source[0], limit=source[1])
    if stop < 1:
        return {}
    run_answer_stage(target, data, prompts, config.answers, log)
    if stop < 2:
        return {}
    shards = [p for split in SPLITS for p in answer_shards(data, split, len(prompts), config.answers)]
    features = work / "features"
    run_feature_stage(target.model, layers, shards, features, config.teacher_batch_size, log)
    if stop < 3:
        return {}
    if fmt.name != "none":  # the head starts from the float32 target's output rows and trains in float32
        del target
        target = load_target(config.target, NONE)
    model = target.model
    categories = [p.category for p in prompts]
    train = CampaignRecords(shards, features, keep=lambda i: not config.held_out(i), categories=categories)
    held = CampaignRecords(answer_shards(data, "greedy", len(prompts), config.answers), features,
                           keep=config.held_out, categories=categories)
    eos = target.tokenizer.eos_token_id
    data_head = train_on_data(model, layers, train, held, config.train, work, eos, log, target_format=fmt.name)
    if stop < 4:
        return {}
    if not config.on_policy_stage:
        log("on_policy: skipped (on_policy_stage is off)")
        return evaluate(config, target, layers, {"data": data_head}, log) if stop >= 5 else {}
    greedy = answer_shards(data, "greedy", len(prompts), config.answers)
    on_policy = CampaignRecords(greedy, features, keep=lambda i: not config.held_out(i), categories=categories)
    if not (work / "heads" / "on_policy").exists():
        head = load_feature_head(data_head, model.config, embed=model.get_input_embeddings(), dtype=torch.float32)
        rejected = run_on_policy_stage(head, on_policy, [p.stem for p in greedy], work, config.on_policy, log)
        on_policy.focus = rejection_focus(rejected, config.train.on_policy.ttt_steps, config.on_policy_boost)
    op_head = train_on_policy(model, data_head, on_policy, train, held, config.train, work, log)
    if stop < 5:
        return {}
    return evaluate(config, target, layers, {"data": data_head, "on_policy": op_head}, log)


def evaluate(config: CampaignConfig, target, layers, heads: dict[str, Path], log: Callable[[str], None]) -> dict:
    """Measure the shipped head and the candidates with the target at the campaign's weight format;
    ship the best candidate when it beats the shipped one.

    `target` is the one the heads trained with (float32); at another format the target is loaded
    again at that format, beside it (the models are small), so that the records, the agreement and
    the `sd` sessions all measure the target the heads draft for."""
    if config.evaluation.prompts is None:
        raise UsageError("the campaign needs evaluation prompts (EvalConfig.prompts)")
    work = Path(config.work)
    fmt = WeightFormat.parse(config.quant)
    if target.format != fmt:
        target = load_target(config.target, fmt)
    records = eval_records(target, layers, config.evaluation, work)
    results = {name: measure(name, folder, target, config.target, records, config.evaluation, work, log)
               for name, folder in heads.items()}
    report: dict = {"target_format": fmt.name, "candidates": results}
    compared = dict(heads)
    if config.ship_to is not None and (Path(config.ship_to) / "config.json").exists():
        report["shipped"] = measure("shipped", Path(config.ship_to), target, config.target, records, config.evaluation, work, log)
        compared["shipped"] = Path(config.ship_to)
    defaults = tau_default(config.target, compared, config.evaluation, fmt)
    for name, figures in defaults.items():
        (report["shipped"] if name == "shipped" else results[name])["tau_default"] = figures
    log("eval: default tau, every head in one interleaved loop: "
        + ", ".join(f"{name} {figures['tau']:.3f}" for name, figures in defaults.items()))
    if "shipped" in report:
        shipped = report["shipped"]
        winners = [n for n in results if better(results[n], shipped)]
        best = max(winners, key=lambda n: (results[n]["tau_default"]["tau"], results[n]["agreement"][0]), default=None)
        report["decision"] = f"ship {best}" if best else "keep the shipped head"
        if best:
            ship(heads[best], Path(config.ship_to))
    paths.atomic_write_json(Path(config.data) / "eval-report.json", report)
    log(f"eval: {report.get('decision', 'no shipped head to compare with')}")
    return report


def status(config: CampaignConfig) -> list[str]:
    """One line per stage: how far it got (read from the files alone, nothing is loaded)."""
    data, work = Path(config.data), Path(config.work)
    source = _prompt_source(data)
    if source is not None:
        lines = [f"prompts: {source[1]} prompts of {source[0]}, target format {_recorded(data)['target_format']}"]
        n = source[1]
    else:
        raw = raw_shards(data, config.prompts)
        lines = [f"prompts: {sum(p.exists() for p in raw)}/{len(raw)} request shards"
                 + (f", {len(load_prompts(data / PROMPTS))} prompts kept" if (data / PROMPTS).exists() else "")]
        if not (data / PROMPTS).exists():
            return lines
        n = len(load_prompts(data / PROMPTS))
    shards = {split: answer_shards(data, split, n, config.answers) for split in SPLITS}
    done = [p for split in SPLITS for p in shards[split] if p.exists()]
    gen = sum(store.SequenceShard.load(p).generated for p in done)
    lines.append("answers: " + ", ".join(f"{split} {sum(p.exists() for p in shards[split])}/{len(shards[split])} shards"
                                         for split in SPLITS) + f" ({gen} generated tokens)")
    all_shards = [p for split in SPLITS for p in shards[split]]
    lines.append(f"features: {sum((work / 'features' / p.stem).exists() for p in all_shards)}/{len(all_shards)} shards")
    ckpt = work / "train" / "head.ckpt"
    step = torch.load(ckpt, weights_only=True)["state"]["step"] if ckpt.exists() else 0
    lines.append(f"train: step {step}/{config.train.data.steps}" + (", head saved" if (work / "heads" / "data").exists() else ""))
    ops = [work / "on_policy" / f"{p.stem}.npz" for p in shards["greedy"]]
    lines.append(f"on_policy: {sum(p.exists() for p in ops)}/{len(ops)} answer shards simulated"
                 + (", head saved" if (work / "heads" / "on_policy").exists() else ""))
    lines.append("eval: " + ("done" if (data / "eval-report.json").exists() else "not yet"))
    return lines


# ---------------------------------------------------------------------- the campaign's record
RECORD = "campaign.json"


def _recorded(folder: Path) -> Optional[dict]:
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def _prompt_source(data: Path) -> Optional[tuple[Path, int]]:
    """(prompts file, prompts used) when the record names another campaign's prompts."""
    rec = _recorded(data) or {}
    src = rec.get("prompts_from")
    return None if src is None else ((Path(data) / src["path"]).resolve(), int(src["count"]))


def prompt_lines_sha256(path: Path, count: int) -> str:
    """sha256 of the first `count` lines of `path` (a campaign's prompts.jsonl only grows at its end:
    later rounds append, a change to a kept prompt is refused, so the lines used stay these)."""
    lines = Path(path).read_bytes().splitlines(keepends=True)
    if len(lines) < count:
        raise UsageError(f"{path} has {len(lines)} lines, fewer than the {count} prompts this campaign used")
    return hashlib.sha256(b"".join(lines[:count])).hexdigest()


def _has_campaign_files(folder: Path) -> bool:
    return any((Path(folder) / part).exists() for part in ("prompts", PROMPTS, "answers", "features", "train", "heads"))


def check_record(config: CampaignConfig) -> Optional[tuple[Path, int]]:
    """Check (or write) the record of the target's format in the data and work folders; returns the
    prompts named by the record (file, number used), or None when the campaign writes its own.

    A folder without a record that holds campaign files was made by the float32 target; a run
    asking for another format than a folder holds is refused (its answers or features would mix two
    targets). The default format writes no record, so a float32 campaign's folders stay as they were."""
    fmt = WeightFormat.parse(config.quant).name
    data, work = Path(config.data), Path(config.work)
    for folder in (data, work):
        rec = _recorded(folder)
        held = rec["target_format"] if rec else ("none" if _has_campaign_files(folder) else None)
        if held is not None and held != fmt:
            raise UsageError(f"{folder} holds a campaign of the {_format_words(held)} target, not the "
                             f"{_format_words(fmt)} one: resume it with --quant {held}, or use another folder")
    rec = _recorded(data)
    want_from = None
    if config.prompts_from is not None:
        src = Path(config.prompts_from).resolve()
        recorded = _prompt_source(data)
        if recorded is not None:
            if recorded[0] != src:
                raise UsageError(f"{data} uses the prompts of {recorded[0]}, not {src}")
        elif (data / PROMPTS).exists() or (data / "answers").exists():
            raise UsageError(f"{data} already holds its own prompts or answers: it cannot take {src}'s")
        else:
            count = len(load_prompts(src))
            data.mkdir(parents=True, exist_ok=True)
            want_from = {"path": os.path.relpath(src, data.resolve()), "count": count,
                         "sha256": prompt_lines_sha256(src, count)}
    if want_from is not None or (rec is None and fmt != "none"):
        data.mkdir(parents=True, exist_ok=True)
        rec = {**(rec or {"target_format": fmt}), **({"prompts_from": want_from} if want_from else {})}
        paths.atomic_write_json(data / RECORD, rec)
    if fmt != "none" and _recorded(work) is None:
        work.mkdir(parents=True, exist_ok=True)
        paths.atomic_write_json(work / RECORD, {"target_format": fmt})
    source = _prompt_source(data)
    if source is not None:
        digest = prompt_lines_sha256(*source)
        if digest != rec["prompts_from"]["sha256"]:
            raise UsageError(f"the first {source[1]} prompts of {source[0]} changed since this campaign used them "
                             f"(sha256 {digest[:12]}, recorded {rec['prompts_from']['sha256'][:12]})")
    return source


def _format_words(fmt: str) -> str:
    return "float32" if fmt == "none" else fmt
