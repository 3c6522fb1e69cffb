"""EAGLE-3 heads over tiny targets, shared by the feature drafter's tests and those that draft with
a head (a helper module, not a test file)."""

from __future__ import annotations

import torch

from conftest import TinyTokenizer
from support.engine_cases import prompt_for as _prompt_for
from viasd_core.speculation.engine import Engine
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.speculation.hybrid_drafter import HybridDrafter
from viasd_core.runtime.model import FastModel
from viasd_core.training import eagle_init

LAYERS = (1, 2, 3)


def make_head(target, draft_vocab=64, seed=0, full=False):
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    vocab_map = torch.arange(vocab) if full else torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    head = eagle_init.init_head(target, LAYERS, vocab_map, seed=seed)
    with torch.no_grad():  # a head that is not the identity-on-the-top-feature start
        for p in head.midlayer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    head.requires_grad_(False).eval()
    head.allocate(256)
    return head


def engine_with_head(target, head, slim_layers=None, hybrid=False, max_len=128):
    fast = FastModel(target, max_len=max_len)
    drafter = FeatureDrafter(head, fast)
    if hybrid:
        drafter = HybridDrafter(drafter)
    slim = FastModel(target, layer_ids=slim_layers, max_len=max_len, name="slim") if slim_layers else None
    return Engine(fast, TinyTokenizer(), drafter=drafter, slim=slim)


def prompt_for(seed, length=12):
    return _prompt_for(seed, length, base=300)
