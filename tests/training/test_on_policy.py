"""On-policy data (viasd_core/training/on_policy.py): the block walk over known drafts, and the
simulated rejections equal to what greedy `sd` with the head does in the engine (the reference)."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, TinyTokenizer, tiny_model
from viasd_core.speculation.engine import Engine
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.runtime.model import FastModel
from viasd_core.training import eagle_data, eagle_init, eagle_train
from viasd_core.training.on_policy import BlockWalk, OnPolicyConfig, sd_rollouts, simulate_blocks, walk_blocks

LAYERS = (1, 2, 3)


def test_the_walk_keeps_leading_agreements_emits_one_more_and_records_the_first_miss():
    tokens = list(range(100, 120))  # prompt 0..3, then 16 generated tokens
    drafts = torch.full((3, 20), -1)
    # block at 4: drafts 4, 5 right, 6 wrong -> kept 2, rejection (6, 2), next block at 7
    drafts[0, 4], drafts[1, 5], drafts[2, 6] = 104, 105, 0
    # block at 7: all three right -> next block at 11
    drafts[0, 7], drafts[1, 8], drafts[2, 9] = 107, 108, 109
    # block at 11: the first wrong -> rejection (11, 0), next at 12, which misses too, and so on
    w = walk_blocks(drafts, tokens, prompt_len=4, gamma=3, max_new=16)
    assert w.rejections[:3] == [(6, 2), (11, 0), (12, 0)]
    assert w.kept == 5 and w.new_tokens == 16
    # blocks shrink near max_new (at most max_new - emitted - 1 drafts), the last step is plain
    starts = [4, 7, 11] + list(range(12, 20))
    assert w.target_passes == len(starts)
    assert w.drafted == sum(min(3, 16 - (n - 4) - 1) for n in starts)
    assert all(t < 20 for t, _ in w.rejections) and (19, 0) not in w.rejections  # the plain step drafts nothing
    # a sequence that ends early (its EOS) ends the walk; a block running past it records no miss
    short = walk_blocks(drafts, tokens[:9], prompt_len=4, gamma=3, max_new=16)
    assert short.rejections == [(6, 2)] and short.new_tokens == 5 and short.kept == 2 + 2


def _engine(target, head):
    fast = FastModel(target, max_len=128)
    return Engine(fast, TinyTokenizer(), drafter=FeatureDrafter(head, fast))


def _records(target, seqs, prompt_lens):
    out = []
    with torch.no_grad():
        for s, p in zip(seqs, prompt_lens):
            ids = torch.tensor(s)
            hs = target(ids[None], output_hidden_states=True).hidden_states
            feats = torch.cat([hs[l][0] for l in LAYERS], dim=-1)  # float32, as `sd` sees them
            out.append(eagle_data.FeatureRecord(ids, feats, torch.zeros(len(s), 1, dtype=torch.long),
                                                 torch.zeros(len(s), 1), p))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_simulated_blocks_find_the_rejections_sd_finds(family):
    """A head fitted to the target's answers to these prompts (so that it agrees often and misses at
    every draft index), then greedy `sd` in the engine against the walk over its parallel drafts."""
    target = tiny_model(family, n_layers=5, seed=11)
    head = eagle_init.init_head(target, LAYERS, torch.arange(target.config.vocab_size), seed=3)
    config = OnPolicyConfig(max_new_tokens=40, gamma=4, batch_size=3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in (5, 12, 9, 16)]
    head.allocate(256)
    seqs, _ = sd_rollouts(_engine(target, head), prompts, config)  # the target's greedy answers
    teacher = eagle_data.teacher_pass(target, [(s, len(p), "") for s, p in zip(seqs, prompts)], LAYERS)
    eagle_train.train_head(head, teacher, eagle_train.HeadTrainConfig(steps=60, batch_size=4, lr=3e-3, warmup=5,
                                                                      bf16=False, checkpoint_every=10 ** 9,
                                                                      eval_every=10 ** 9))
    head.requires_grad_(False).eval()
    head.allocate(256)
    seqs, walks = sd_rollouts(_engine(target, head), prompts, config)
    sim = simulate_blocks(head, _records(target, seqs, [len(p) for p in prompts]), config)
    for ref, got in zip(walks, sim):
        assert got.rejections == ref.rejections
        assert (got.new_tokens, got.target_passes, got.drafted, got.kept) == \
               (ref.new_tokens, ref.target_passes, ref.drafted, ref.kept)
    steps = {j for w in walks for _, j in w.rejections}
    assert steps == {0, 1, 2, 3}, steps  # misses at every draft index
    assert all(isinstance(w, BlockWalk) for w in sim)
