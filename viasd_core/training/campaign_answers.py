"""Stage 2 of the campaign: the target's own answers to the prompts, greedy and sampled, as token ids.

Shard k of a split answers prompts [k * shard_size, (k + 1) * shard_size) of `prompts.jsonl` in
batched generation (teacher_answers.build_dataset) and is written as `answers/<split>-NNNNN.npz`
(campaign_store.SequenceShard: uint16 token ids, compressed, no pickle). A killed run resumes at the
first missing shard; a sampled shard's generator is seeded by its index, so a resumed run writes the
same shards as an uninterrupted one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from viasd_core.loading.models import Loaded
from viasd_core.loading.prompts import Prompt, load_prompts
from viasd_core.training import campaign_store as store
from viasd_core.training.teacher_answers import build_dataset

SPLITS = ("greedy", "sampled")


@dataclass
class AnswerConfig:
    max_new_tokens: int = 192
    temperature: float = 0.8  # the sampled split's
    shard_size: int = 256
    batch_size: int = 32  # measured fastest on a 2-core CPU (docs/distill.md)
    max_prompt_tokens: int = 1024
    seed: int = 0


def answer_shards(data: Path, split: str, n_prompts: int, config: AnswerConfig) -> list[Path]:
    count = len(store.chunks(range(n_prompts), config.shard_size))
    return [data / "answers" / f"{store.shard_name(split, k)}.npz" for k in range(count)]


def run_answer_stage(target: Loaded, data: Path, prompts: Path | Sequence[Prompt], config: AnswerConfig,
                     log: Callable[[str], None]) -> None:
    """Generate every missing answer shard of both splits (greedy first) for `prompts` (a prompts
    file, or the prompts themselves), with the target as loaded (its weight format included)."""
    if isinstance(prompts, (str, Path)):
        prompts = load_prompts(prompts)
    vocab = int(target.model.config.vocab_size)
    for split in SPLITS:
        temperature = 0.0 if split == "greedy" else config.temperature
        shards = answer_shards(data, split, len(prompts), config)
        for k, path in enumerate(shards):
            if path.exists():
                continue
            lo = k * config.shard_size
            chunk = prompts[lo : lo + config.shard_size]
            t0 = time.perf_counter()
            records = build_dataset(target, [p.text for p in chunk], config.max_new_tokens, batch_size=config.batch_size,
                                    temperature=temperature, seed=config.seed * 100_003 + k,
                                    max_prompt_tokens=config.max_prompt_tokens,
                                    progress=lambda i, n: log(f"answers {split} shard {k + 1}/{len(shards)}: {i}/{n}"))
            shard = store.SequenceShard([r.input_ids.numpy() for r in records], [r.prompt_len for r in records],
                                        list(range(lo, lo + len(chunk))))
            shard.save(path, vocab)
            dt = time.perf_counter() - t0
            log(f"answers {split} shard {k + 1}/{len(shards)}: {shard.generated} tokens in {dt:.0f} s "
                f"({shard.generated / dt:.1f} tokens/s)")
