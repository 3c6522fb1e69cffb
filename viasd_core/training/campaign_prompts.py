"""Stage 1 of the campaign: prompts, most of them written by the target itself.

The requests (prompt_requests.build_requests) are answered shard by shard, sampled, into
`prompts/raw-NNNNN.jsonl` (one line per request: its category and the prompt made from the reply, or
null). A killed run resumes at the first missing shard; each shard's sampling is seeded by its index,
so the result does not depend on where a run stopped. When every shard is there, the candidates (the
extra prompt files first, then the shards in order) are filtered (prompt_filter.select: near
duplicates and anything near an evaluation prompt go) into `prompts.jsonl`.

Later rounds (`PromptConfig.more`: other seeds and kind mixes, in `prompts/<round>-NNNNN.jsonl`) can be
added after the file exists. The filter keeps the first of each near-duplicate group in order, so the
prompts already kept keep their ids (answers already made stay valid) and the new ones are appended;
a change that would move an existing prompt is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from viasd_core import paths
from viasd_core.errors import UsageError
from viasd_core.loading.models import Loaded
from viasd_core.loading.prompts import load_prompts
from viasd_core.training import campaign_store as store
from viasd_core.training.prompt_filter import evaluation_index, select
from viasd_core.training.prompt_requests import Request, build_requests, parse_reply
from viasd_core.training.teacher_answers import build_dataset

PROMPTS = "prompts.jsonl"
REPORT = "prompts-report.json"


@dataclass(frozen=True)
class RequestRound:
    """A later round of requests: its own shard files, seed and kind mix (prompt_requests.MIXES)."""

    name: str
    requests: int
    seed: int
    mix: str = "all"


@dataclass
class PromptConfig:
    requests: int = 6000  # things asked of the target (and plain templates)
    shard_size: int = 400
    temperature: float = 0.9
    batch_size: int = 32
    seed: int = 0
    extra: list[Path] = field(default_factory=list)  # prompt files taken as they are (before the requests)
    evaluation: list[Path] = field(default_factory=list)  # nothing near these is kept
    more: list[RequestRound] = field(default_factory=list)  # later rounds, appended

    def rounds(self) -> list[RequestRound]:
        return [RequestRound("raw", self.requests, self.seed), *self.more]


def _replies(target: Loaded, requests: Sequence[Request], config: PromptConfig, seed: int,
             progress: Callable[[int, int], None]) -> list[str | None]:
    """The prompt each request gives (None: unusable reply); requests with a meta-prompt are answered
    in batches grouped by their token budget."""
    out: list[str | None] = [None if r.meta else r.template for r in requests]
    asked = [i for i, r in enumerate(requests) if r.meta]
    done = 0
    for budget in sorted({requests[i].max_new_tokens for i in asked}):
        group = [i for i in asked if requests[i].max_new_tokens == budget]
        records = build_dataset(target, [requests[i].meta for i in group], budget, batch_size=config.batch_size,
                                temperature=config.temperature, seed=seed * 100 + budget,
                                progress=lambda k, n: progress(done + k, len(asked)))
        for i, rec in zip(group, records):
            reply = target.tokenizer.decode(rec.input_ids[rec.prompt_len :].tolist(), skip_special_tokens=True)
            out[i] = parse_reply(requests[i], reply)
        done += len(group)
    return out


def raw_shards(data: Path, config: PromptConfig, round_: RequestRound | None = None) -> list[Path]:
    """The request shard files of one round, or of every round in order."""
    if round_ is None:
        return [p for r in config.rounds() for p in raw_shards(data, config, r)]
    count = len(store.chunks(range(round_.requests), config.shard_size))
    return [data / "prompts" / f"{store.shard_name(round_.name, k)}.jsonl" for k in range(count)]


def _rounds_record(config: PromptConfig) -> list[dict]:
    return [{"name": r.name, "requests": r.requests, "seed": r.seed, "mix": r.mix} for r in config.rounds()]


def _up_to_date(data: Path, config: PromptConfig) -> bool:
    if not (data / PROMPTS).exists():
        return False
    report = json.loads((data / REPORT).read_text(encoding="utf-8"))
    made = report.get("rounds") or [{"name": "raw", "requests": report["requests"], "seed": config.seed, "mix": "all"}]
    return made == _rounds_record(config)


def run_prompt_stage(target: Loaded, data: Path, config: PromptConfig, log: Callable[[str], None]) -> Path:
    """Answer the missing request shards of every round, then (re)write the filtered prompts file when
    a round was added. Returns its path."""
    final = data / PROMPTS
    if _up_to_date(data, config):
        log(f"prompts: {final} exists")
        return final
    for round_ in config.rounds():
        requests = build_requests(round_.requests, round_.seed, round_.mix)
        shards = store.chunks(requests, config.shard_size)
        files = raw_shards(data, config, round_)
        for k, path in enumerate(files):
            if path.exists():
                continue
            prompts = _replies(target, shards[k], config, seed=round_.seed * 100_003 + k,
                               progress=lambda i, n: log(f"prompts {round_.name} shard {k + 1}/{len(files)}: {i}/{n} replies"))
            lines = [json.dumps({"category": r.category, "prompt": p, "source": "target" if r.meta else "template"})
                     for r, p in zip(shards[k], prompts)]
            paths.atomic_write_text(path, "\n".join(lines) + "\n")
            log(f"prompts {round_.name} shard {k + 1}/{len(files)}: {sum(p is not None for p in prompts)}/{len(prompts)} usable")
    return finish_prompts(data, config, log)


def finish_prompts(data: Path, config: PromptConfig, log: Callable[[str], None]) -> Path:
    """Filter every candidate into `prompts.jsonl` (id = its line) and a report of what was dropped.
    An existing file may only grow: its rows must come back unchanged, in order."""
    candidates = [{"category": p.category, "prompt": p.text, "source": Path(f).name}
                  for f in config.extra for p in load_prompts(f)]
    for path in raw_shards(data, config):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        candidates += [row for row in rows if row["prompt"]]
    evaluation = evaluation_index(p.text for f in config.evaluation for p in load_prompts(f))
    kept, dropped = select([c["prompt"] for c in candidates], evaluation)
    rows = [candidates[i] for i in kept]
    text = "".join(json.dumps({"id": n, **row}) + "\n" for n, row in enumerate(rows))
    old = (data / PROMPTS).read_text(encoding="utf-8") if (data / PROMPTS).exists() else ""
    if not text.startswith(old):
        raise UsageError(f"{data / PROMPTS}: the new request rounds would change prompts already kept "
                         "(their answers would no longer match); add rounds after the existing ones only")
    paths.atomic_write_text(data / PROMPTS, text)
    report = {"requests": sum(r.requests for r in config.rounds()), "rounds": _rounds_record(config),
              "candidates": len(candidates), "kept": len(rows), "dropped": dropped,
              "by_category": dict(sorted(Counter(r["category"] for r in rows).items())),
              "by_source": dict(sorted(Counter(r["source"] for r in rows).items())),
              "evaluation_files": [Path(f).name for f in config.evaluation]}
    paths.atomic_write_json(data / REPORT, report)
    log(f"prompts: {len(rows)} kept of {len(candidates)} candidates (dropped {dropped})"
        + (f", {len(rows) - old.count(chr(10))} new" if old else ""))
    return data / PROMPTS
