"""Stage 1 of the campaign: prompts, most of them written by the target itself.

The requests (prompt_requests.build_requests) are answered shard by shard, sampled, into
`prompts/raw-NNNNN.jsonl` (one line per request: its category and the prompt made from the reply, or
null). A killed run resumes at the first missing shard; each shard's sampling is seeded by its index,
so the result does not depend on where a run stopped. When every shard is there, the candidates (the
extra prompt files first, then the shards in order) are filtered (prompt_filter.select: near
duplicates and anything near an evaluation prompt go) into `prompts.jsonl`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from viasd_core import paths
from viasd_core.loading.models import Loaded
from viasd_core.loading.prompts import load_prompts
from viasd_core.training import campaign_store as store
from viasd_core.training.prompt_filter import evaluation_index, select
from viasd_core.training.prompt_requests import Request, build_requests, parse_reply
from viasd_core.training.teacher_answers import build_dataset

PROMPTS = "prompts.jsonl"


@dataclass
class PromptConfig:
    requests: int = 6000  # things asked of the target (and plain templates)
    shard_size: int = 400
    temperature: float = 0.9
    batch_size: int = 32
    seed: int = 0
    extra: list[Path] = field(default_factory=list)  # prompt files taken as they are (before the requests)
    evaluation: list[Path] = field(default_factory=list)  # nothing near these is kept


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


def raw_shards(data: Path, config: PromptConfig) -> list[Path]:
    count = len(store.chunks(range(config.requests), config.shard_size))
    return [data / "prompts" / f"{store.shard_name('raw', k)}.jsonl" for k in range(count)]


def run_prompt_stage(target: Loaded, data: Path, config: PromptConfig, log: Callable[[str], None]) -> Path:
    """Answer the missing request shards, then write (once) the filtered prompts file. Returns its path."""
    final = data / PROMPTS
    if final.exists():
        log(f"prompts: {final} exists")
        return final
    requests = build_requests(config.requests, config.seed)
    shards = store.chunks(requests, config.shard_size)
    for k, path in enumerate(raw_shards(data, config)):
        if path.exists():
            continue
        prompts = _replies(target, shards[k], config, seed=config.seed * 100_003 + k,
                           progress=lambda i, n: log(f"prompts shard {k + 1}/{len(shards)}: {i}/{n} replies"))
        lines = [json.dumps({"category": r.category, "prompt": p, "source": "target" if r.meta else "template"})
                 for r, p in zip(shards[k], prompts)]
        paths.atomic_write_text(path, "\n".join(lines) + "\n")
        log(f"prompts shard {k + 1}/{len(shards)}: {sum(p is not None for p in prompts)}/{len(prompts)} usable")
    return finish_prompts(data, config, log)


def finish_prompts(data: Path, config: PromptConfig, log: Callable[[str], None]) -> Path:
    """Filter every candidate into `prompts.jsonl` (id = its line) and a report of what was dropped."""
    candidates = [{"category": p.category, "prompt": p.text, "source": Path(f).name}
                  for f in config.extra for p in load_prompts(f)]
    for path in raw_shards(data, config):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        candidates += [row for row in rows if row["prompt"]]
    evaluation = evaluation_index(p.text for f in config.evaluation for p in load_prompts(f))
    kept, dropped = select([c["prompt"] for c in candidates], evaluation)
    rows = [candidates[i] for i in kept]
    paths.atomic_write_text(data / PROMPTS, "".join(json.dumps({"id": n, **row}) + "\n" for n, row in enumerate(rows)))
    report = {"requests": config.requests, "candidates": len(candidates), "kept": len(rows), "dropped": dropped,
              "by_category": dict(sorted(Counter(r["category"] for r in rows).items())),
              "by_source": dict(sorted(Counter(r["source"] for r in rows).items())),
              "evaluation_files": [Path(f).name for f in config.evaluation]}
    paths.atomic_write_json(data / "prompts-report.json", report)
    log(f"prompts: {len(rows)} kept of {len(candidates)} candidates (dropped {dropped})")
    return data / PROMPTS
