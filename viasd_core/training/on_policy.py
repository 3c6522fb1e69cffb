"""Stage 5 of the campaign: where the trained head's own drafts fail (on-policy data, Draft-OPD style).

Greedy `sd` with the head alone (no prompt lookup, so every proposal is the head's), in blocks of a
fixed `gamma` drafts (the adaptive policy decides from measured wall times, which would make the
data depend on the machine's load), emits the target's greedy text; every block whose drafts were
not all kept gives one rejection: (token position n + kept, draft index kept).

Two ways to find those rejections, equal up to float rounding:

- `sd_rollouts`, the reference: run the engine and watch its StepResults. It costs a full target
  pass per block: about 4 hours of this CPU for 1,200 answers of 192 tokens.
- `simulate_blocks`, what the campaign runs: the target's greedy answers and their features are
  already stored (stages 2 and 3), and one training-time-test pass of the head over a sequence
  (`eagle_ttt.ttt_logits` with `gamma` steps) gives, at every position, the chain of drafts a
  block starting there proposes (step j of head row q is the j-th draft of the block whose first
  draft is token q + 2 - j; the teacher tokens it is fed equal the head's own drafts wherever those
  were kept, which is all a greedy chain looks at). Walking the blocks over those drafts as the
  engine does gives the same rejections for the cost of a forward pass of the head: minutes for
  every training answer. The stored features are bfloat16 where `sd` sees float32, so a near-tie
  may fall the other way; benchmarks/experiments/campaign_measure.py `on-policy-check` measures how often on
  the real pair (docs/campaign.md section 5), tests/training/test_on_policy.py checks equality on float32
  features.

`run_on_policy_stage` simulates every greedy training answer, one answer shard at a time, into
`work/on_policy/<shard>.npz` (written atomically; a killed run resumes at the first missing shard).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from viasd_core.speculation.engine import GenerationConfig
from viasd_core.training import campaign_store as store
from viasd_core.training.eagle_data import FeatureRecord
from viasd_core.training.eagle_ttt import make_batch, ttt_logits


@dataclass
class OnPolicyConfig:
    max_new_tokens: int = 192  # as the answers were made (campaign_answers.AnswerConfig)
    gamma: int = 4  # drafts per block, fixed: the adaptive policy's choices follow wall times, not the data
    batch_size: int = 8  # sequences per head pass


@dataclass
class BlockWalk:
    """What greedy `sd` in fixed blocks did over one sequence."""

    rejections: list[tuple[int, int]] = field(default_factory=list)  # (token position, draft index)
    new_tokens: int = 0
    target_passes: int = 0
    drafted: int = 0
    kept: int = 0


def walk_blocks(drafts: torch.Tensor, tokens: Sequence[int], prompt_len: int, gamma: int, max_new: int) -> BlockWalk:
    """The engine's fixed-block loop over a known greedy sequence. `drafts[j, t]` is the token the
    head proposes as draft j of the block whose first draft is at position t - j. A block at n drafts
    min(gamma, max_new - emitted - 1) tokens (none: a plain step), keeps the leading ones equal to
    `tokens` and emits one more; the sequence's end (its EOS or `max_new`) ends the walk."""
    out = BlockWalk()
    end = min(len(tokens), prompt_len + max_new)
    n = prompt_len
    while n < end:
        g = min(gamma, max_new - (n - prompt_len) - 1)
        out.target_passes += 1
        k = 0
        if g > 0:
            while k < g and n + k < end and int(drafts[k, n + k]) == int(tokens[n + k]):
                k += 1
            out.drafted += g
            out.kept += k
            if k < g and n + k < end:
                out.rejections.append((n + k, k))
        n += k + 1
    out.new_tokens = min(n, end) - prompt_len
    return out


@torch.no_grad()
def head_drafts(head, records: Sequence[FeatureRecord], gamma: int) -> list[torch.Tensor]:
    """Per record, [gamma, L] target ids: `drafts[j, t]` as walk_blocks reads it (-1 where undefined).
    One training-time-test pass over a batch; head row q's step j proposes token q + 2."""
    tokens, feats, T = make_batch(records, max_len=1 << 20)
    device = head.fc.weight.device
    logits = ttt_logits(head, tokens.to(device), feats.to(device, head.dtype), gamma)
    out = []
    for b, r in enumerate(records):
        L = r.tokens.numel()
        d = torch.full((gamma, L), -1, dtype=torch.long)
        for j, lg in enumerate(logits):
            rows = min(T, L - 2)
            if rows > j:
                d[j, j + 2 : rows + 2] = head.to_target_ids(lg[b, j:rows].argmax(-1)).cpu()
        out.append(d)
    return out


def simulate_blocks(head, records: Sequence[FeatureRecord], config: OnPolicyConfig) -> list[BlockWalk]:
    """walk_blocks over each record, the drafts from `head_drafts` (batches of similar length)."""
    order = sorted(range(len(records)), key=lambda n: records[n].tokens.numel())
    walks: list[BlockWalk | None] = [None] * len(records)
    for batch in store.chunks(order, config.batch_size):
        recs = [records[n] for n in batch]
        for n, r, d in zip(batch, recs, head_drafts(head, recs, config.gamma)):
            walks[n] = walk_blocks(d, r.tokens.tolist(), r.prompt_len, config.gamma, config.max_new_tokens)
    return walks  # type: ignore[return-value]


def sd_rollouts(engine, prompts: Sequence[list[int]], config: OnPolicyConfig) -> tuple[list[list[int]], list[BlockWalk]]:
    """The reference: greedy `sd` in fixed blocks on each prompt (token ids), the engine reset before
    each. Returns the sequences (prompt + emitted) and what each run did, rejections as an Engine
    observer saw them."""
    walk = [BlockWalk()]

    def observe(_engine, result) -> None:
        if result.drafted > 0 and result.kept < result.drafted:
            walk[0].rejections.append((result.position + result.kept, result.kept))

    engine.observers.append(observe)
    seqs, walks = [], []
    try:
        for ids in prompts:
            walk[0] = BlockWalk()
            engine.reset()
            gen = engine.generate(list(ids), GenerationConfig(mode="sd", max_new_tokens=config.max_new_tokens,
                                                              gamma=config.gamma, adaptive=False))
            w = walk[0]
            w.new_tokens, w.target_passes = gen.stats.new_tokens, gen.stats.target_passes
            w.drafted, w.kept = sum(gen.stats.position_attempts), sum(gen.stats.position_accepts)
            seqs.append(list(ids) + gen.tokens)
            walks.append(w)
    finally:
        engine.observers.remove(observe)
    return seqs, walks


def run_on_policy_stage(head, records, shard_names: Sequence[str], work: Path, config: OnPolicyConfig,
                        log: Callable[[str], None]) -> dict[str, list[tuple[int, int, int]]]:
    """Simulate `sd` with `head` over `records` (campaign_features.CampaignRecords of greedy training
    answers), one answer shard at a time, each into `work/on_policy/<shard>.npz`. Returns, per shard
    name, (sequence index in the shard, token position, draft index) of every rejected draft."""
    folder = work / "on_policy"
    by_shard: dict[str, list[int]] = {}
    for n in range(len(records)):
        by_shard.setdefault(records.names[records.index[n][0]], []).append(n)
    out = {}
    for k, name in enumerate(shard_names):
        path = folder / f"{name}.npz"
        if not path.exists() and name in by_shard:
            t0 = time.perf_counter()
            ns = by_shard[name]
            walks = simulate_blocks(head, [records[n] for n in ns], config)
            rows = [(records.index[n][1], t, j) for n, w in zip(ns, walks) for t, j in w.rejections]
            rej = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
            new, passes = sum(w.new_tokens for w in walks), sum(w.target_passes for w in walks)
            store.save_npz(path, seq=rej[:, 0], pos=rej[:, 1], step=rej[:, 2],
                           counts=np.asarray([[w.new_tokens, w.target_passes, w.drafted, w.kept] for w in walks]))
            log(f"on-policy shard {k + 1}/{len(shard_names)}: {len(ns)} answers, {new} tokens in "
                f"{time.perf_counter() - t0:.0f} s, {len(rows)} rejections, tau {new / max(passes, 1):.2f}")
        if path.exists():
            x = store.load_npz(path)
            out[name] = list(zip(x["seq"].tolist(), x["pos"].tolist(), x["step"].tolist()))
    return out
