"""The tier rule is one function (speculation/router.route_tiers): the engine's tiers for a routed block
(`block_tiers`) are the kernels' own tiers with the confidence condition on top, and replay routes
recorded gates through the same function."""

from __future__ import annotations

import pytest
import torch
from viasd_kernels import TIER_ACCEPT, TIER_FULL, TIER_SLIM, route_block

from viasd_core.speculation.router import OFF, Thresholds, block_tiers, route_tiers, slim_confidence, unsure_to_full


@pytest.mark.parametrize("seed", range(6))
def test_the_engine_and_replay_route_a_block_alike(seed):
    g = torch.Generator().manual_seed(seed)
    G, V = 6, 64
    logits = torch.randn(G + 1, V, generator=g) * 3
    draft = torch.randint(0, V, (G,), generator=g)
    draft[: G // 2] = logits[: G // 2].argmax(-1)  # some drafts agree with the slim: gate 1
    for th in (Thresholds(0.9, 0.2, 0.0), Thresholds(0.5, 0.05, 0.6), Thresholds(OFF, OFF, 0.0), Thresholds(0.99, 0.3, 0.95)):
        route = route_block(logits, draft, 0.0, th.accept, th.slim)
        conf = slim_confidence(route, G)
        tiers = block_tiers(route, G, th)
        assert torch.equal(tiers, unsure_to_full(route.tiers, conf, th))  # the fused kernel's tiers, then confidence
        assert torch.equal(tiers, route_tiers(route.gate.clone(), conf.clone(), th))  # what replay computes
        assert set(tiers.tolist()) <= {TIER_ACCEPT, TIER_SLIM, TIER_FULL}
        if th.confidence > 0:
            assert all(t == TIER_FULL for t, c in zip(tiers.tolist(), conf.tolist()) if c < th.confidence)
        if th.accept == OFF and th.slim == OFF:
            assert tiers.tolist() == [TIER_FULL] * G
