"""Stage 5 of the campaign: where the trained head's own drafts fail (on-policy data, Draft-OPD style).

`sd` runs with the head alone (no prompt lookup, so every proposal is the head's), greedy, blocks of
a fixed `gamma` drafts (the adaptive policy decides from measured wall times, which would make the
data depend on the machine's load), on training prompts; an Engine observer sees each StepResult, and every block whose drafts were not
all kept gives one rejection: (token position n + kept, draft index kept). The sequences (prompt +
the text `sd` emitted, equal to the target's greedy text) and their rejections are written in shards,
`on_policy/sd-NNNNN.npz` (campaign_store.SequenceShard with the rejections and counts as extra
arrays); a killed run resumes at the first missing shard. The engine is reset before every prompt,
so a sequence does not depend on the one before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from viasd_core.decoding.engine import GenerationConfig
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.prompts import encode, load_prompts
from viasd_core.session import build_session
from viasd_core.training import campaign_store as store


@dataclass
class OnPolicyConfig:
    prompts: int = 1200  # training prompts run through `sd` (spread evenly over the file)
    shard_size: int = 100
    max_new_tokens: int = 192
    max_context: int = 1024
    gamma: int = 4  # drafts per block, fixed: the adaptive policy's choices follow wall times, not the data


def head_session(target_ref: str, head: Path | str, max_context: int, hybrid: bool = False):
    """A session for `sd` with `head` as the draft (with prompt lookup beside it when `hybrid`), the
    target in float32, eager: what `viasd generate --mode sd -d HEAD --quant none` builds."""
    draft = f"{head}+ngram" if hybrid else str(head)
    return build_session(ModelOptions(model=target_ref, draft=draft, dtype="float32", quant="none",
                                      max_context=max_context, compile="off"), mode="sd")


def chosen_prompts(n_prompts: int, count: int, keep: Callable[[int], bool]) -> list[int]:
    """Up to `count` prompt indices passing `keep`, spread evenly over 0..n_prompts-1."""
    pool = [i for i in range(n_prompts) if keep(i)]
    if len(pool) <= count:
        return pool
    return [pool[int(k * len(pool) / count)] for k in range(count)]


def on_policy_shards(data: Path, n: int, config: OnPolicyConfig) -> list[Path]:
    return [data / "on_policy" / f"{store.shard_name('sd', k)}.npz" for k in range(len(store.chunks(range(n), config.shard_size)))]


def run_on_policy_stage(target_ref: str, head: Path, prompts_file: Path, data: Path, config: OnPolicyConfig,
                        keep: Callable[[int], bool], log: Callable[[str], None]) -> list[Path]:
    """Run `sd` with `head` on the chosen training prompts, shard by shard; returns the shard paths."""
    prompts = load_prompts(prompts_file)
    chosen = chosen_prompts(len(prompts), config.prompts, keep)
    shards = on_policy_shards(data, len(chosen), config)
    session = None
    for k, path in enumerate(shards):
        if path.exists():
            continue
        session = session or head_session(target_ref, head, config.max_context)
        t0 = time.perf_counter()
        shard = _run_shard(session, [prompts[i].text for i in chosen[k * config.shard_size : (k + 1) * config.shard_size]],
                           chosen[k * config.shard_size : (k + 1) * config.shard_size], config)
        shard.save(path, int(session.target.model.config.vocab_size))
        x = shard.extra
        log(f"on-policy shard {k + 1}/{len(shards)}: {int(x['new_tokens'].sum())} tokens in {time.perf_counter() - t0:.0f} s, "
            f"{len(x['rej_seq'])} rejections, tau {x['new_tokens'].sum() / max(int(x['target_passes'].sum()), 1):.2f}")
    return shards


def _run_shard(session, texts: Sequence[str], indices: Sequence[int], config: OnPolicyConfig) -> store.SequenceShard:
    engine = session.engine
    rejections: list[tuple[int, int, int]] = []
    current = [0]

    def observe(_engine, result) -> None:
        if result.drafted > 0 and result.kept < result.drafted:
            rejections.append((current[0], result.position + result.kept, result.kept))

    engine.observers.append(observe)
    seqs, lens, new, passes, drafted, kept = [], [], [], [], [], []
    try:
        for i, text in enumerate(texts):
            current[0] = i
            ids = encode(session.tokenizer, text)[-(config.max_context - config.max_new_tokens - 1) :]
            engine.reset()
            gen = engine.generate(ids, GenerationConfig(mode="sd", max_new_tokens=config.max_new_tokens,
                                                        gamma=config.gamma, adaptive=False))
            seqs.append(np.asarray(ids + gen.tokens, dtype=np.int64))
            lens.append(len(ids))
            new.append(gen.stats.new_tokens)
            passes.append(gen.stats.target_passes)
            drafted.append(sum(gen.stats.position_attempts))
            kept.append(sum(gen.stats.position_accepts))
    finally:
        engine.observers.remove(observe)
    rej = np.asarray(rejections, dtype=np.int64).reshape(-1, 3)
    return store.SequenceShard(seqs, lens, list(indices), {
        "rej_seq": rej[:, 0], "rej_pos": rej[:, 1], "rej_step": rej[:, 2], "new_tokens": np.asarray(new),
        "target_passes": np.asarray(passes), "drafted": np.asarray(drafted), "kept": np.asarray(kept)})


def rejections(shards: Sequence[Path]) -> dict[str, list[tuple[int, int, int]]]:
    """Per shard name: (sequence, token position, draft index) of every rejected draft."""
    out = {}
    for path in shards:
        x = store.SequenceShard.load(path).extra
        out[path.stem] = list(zip(x["rej_seq"].tolist(), x["rej_pos"].tolist(), x["rej_step"].tolist()))
    return out
