"""The draft-length policy: block length from acceptance, plain steps while drafting does not pay."""

import pytest

from conftest import TinyTokenizer, tiny_model
from viasd_core.decoding.draft_policy import DraftPolicy
from viasd_core.decoding.drafters import ModelDrafter
from viasd_core.decoding.engine import Engine, GenerationConfig
from viasd_core.decoding.model import FastModel


def test_block_length_follows_acceptance():
    p = DraftPolicy(gamma=3, gamma_max=5)
    p.record_spec(drafted=3, kept=3, tokens=4, seconds=1.0)
    assert p.gamma == 4
    p.record_spec(drafted=4, kept=1, tokens=2, seconds=1.0)  # rejected before the middle
    assert p.gamma == 3
    p.record_spec(drafted=3, kept=2, tokens=3, seconds=1.0)  # kept half or more: unchanged
    assert p.gamma == 3
    for _ in range(5):
        p.record_spec(drafted=p.gamma, kept=p.gamma, tokens=p.gamma + 1, seconds=1.0)
    assert p.gamma == 5  # capped


def test_plain_steps_while_drafting_does_not_pay_and_probes_again():
    p = DraftPolicy(gamma=4, gamma_max=8, probe_every=3, decay=0.5)
    assert p.block_length() == 4
    p.record_spec(drafted=4, kept=0, tokens=1, seconds=0.03)  # gamma shrinks to 3
    assert p.block_length() == 3
    p.record_spec(drafted=3, kept=0, tokens=1, seconds=0.03)  # gamma 2; 33 tokens/s
    assert p.spec_rate == 1.5 / 0.045
    assert p.block_length() == 0  # drafting measured twice: now measure a plain step
    p.record_plain(tokens=1, seconds=0.02)  # 50 tokens/s: faster than drafting
    assert p.block_length() == 0
    p.record_plain(1, 0.02)
    assert p.block_length() == 0
    p.record_plain(1, 0.02)
    assert p.plain_run == 3 and p.block_length() == 2  # after 3 plain steps, probe drafting again
    p.record_spec(drafted=2, kept=2, tokens=3, seconds=0.01)  # a fast block: (0.75 + 3) / (0.0225 + 0.01)
    assert p.spec_rate == (0.75 + 3) / (0.0225 + 0.01) and p.spec_rate > p.plain_rate
    assert p.block_length() == 3 and p.plain_run == 0
    # a block of six tokens weighs six tokens: rates are sums of tokens over sums of seconds
    q = DraftPolicy(gamma=4, gamma_max=8, decay=1.0)
    q.record_spec(4, 4, 5, 0.05)
    q.record_spec(4, 0, 1, 0.05)
    assert q.spec_rate == 60.0  # not the mean of 100 and 20 tokens/s


def test_fixed_gamma_is_kept():
    p = DraftPolicy(gamma=5, gamma_max=9, adaptive=False)
    for _ in range(4):
        p.record_spec(drafted=5, kept=0, tokens=1, seconds=1.0)
        p.record_plain(1, 0.001)
    assert p.block_length() == 5 and p.gamma == 5


def test_engine_takes_plain_steps_with_a_draft_that_never_agrees_and_stays_exact():
    target = tiny_model("llama", n_layers=4, seed=40)
    draft = tiny_model("llama", n_layers=4, seed=41)  # as costly as the target and never right
    eng = Engine(FastModel(target, max_len=256), TinyTokenizer(),
                 drafter=ModelDrafter(FastModel(draft, max_len=256, name="draft"), 256))
    prompt = list(range(3, 20))
    sd = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=80, gamma=4))
    eng.reset()
    ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=80))
    assert sd.tokens == ar.tokens  # plain steps keep sd exact
    # most steps drafted nothing (the old +1/-1 rule drafted at least one token every step)
    assert sd.stats.draft_tokens < 0.5 * sd.stats.steps, (sd.stats.draft_tokens, sd.stats.steps)


def ms(curve: dict[int, float]) -> dict[int, float]:
    return {w: v / 1000 for w, v in curve.items()}


STEP = ms({1: 10, 4: 10, 5: 13, 8: 13, 16: 40})  # rows four at a time, then dearer (a CPU int4 kernel's shape)


def test_the_measured_acceptance_is_per_position_and_conditional():
    p = DraftPolicy(gamma=3, gamma_max=6, decay=1.0, verify_seconds=STEP)
    assert p.acceptance() == [0.5] * 6  # nothing measured: the prior
    p.record_spec(drafted=3, kept=1, tokens=2, seconds=0.02, draft_seconds=0.003)
    # draft 0 kept, draft 1 rejected, draft 2 never compared
    assert p.attempted == [1, 1] and p.accepted == [1, 0]
    assert p.acceptance() == [0.75, 0.25, 0.25, 0.25, 0.25, 0.25]  # past position 1: position 1's
    assert p.draft_seconds / p.draft_tokens == 0.001
    p.record_spec(drafted=1, kept=1, tokens=2, seconds=0.01)
    assert p.attempted == [2, 1] and p.accepted == [2, 0]
    assert p.gamma == 2  # under a curve, a fully kept block grows from what it drafted


def test_the_block_stops_before_a_dearer_pass_unless_acceptance_pays_for_it():
    p = DraftPolicy(gamma=5, gamma_max=12, decay=1.0, verify_seconds=STEP)
    # p = 0.5: 3 drafts give 1.875 tokens for 10 ms; 7 drafts 1.992 tokens for 13 ms
    assert p.cap() == 3 and p.block_length() == 3
    for _ in range(20):  # every draft kept: p = 20.5 / 21 at each position tried
        p.record_spec(drafted=3, kept=3, tokens=4, seconds=0.01)
    a = 20.5 / 21
    assert p.acceptance() == pytest.approx([a] * 12)
    expected = {g: sum(a ** i for i in range(g + 1)) for g in (3, 7)}
    assert expected[7] / 0.013 > expected[3] / 0.010  # now the dearer pass pays: the cap moves past it
    p.record_plain(tokens=1, seconds=0.02)  # plain steps measured slower: draft
    assert p.cap() == 7 and p.block_length() == 4  # gamma grows one a block up to it
    # a flat curve (a GPU): the block grows as acceptance allows; drafting as dear as a pass: one draft
    flat = DraftPolicy(gamma=5, gamma_max=12, decay=1.0, verify_seconds=ms({1: 10, 16: 11}))
    assert flat.cap() == 6  # at p = 0.5 a 7th draft adds 1/128 of a token for 0.07 ms
    for _ in range(10):
        flat.record_spec(drafted=5, kept=5, tokens=6, seconds=0.01)
    flat.record_plain(tokens=1, seconds=0.02)
    assert flat.cap() == 12 and flat.block_length() == 6
    dear = DraftPolicy(gamma=5, gamma_max=12, decay=1.0, verify_seconds=ms({1: 10, 16: 11}))
    dear.record_spec(drafted=1, kept=0, tokens=1, seconds=0.02, draft_seconds=0.010)
    assert dear.cap() == 1


def test_without_a_curve_the_block_follows_acceptance_alone():
    for curve in (None, {}):
        p = DraftPolicy(gamma=5, gamma_max=12, verify_seconds=curve)
        assert p.verify_seconds is None and p.block_length() == 5
        p.record_spec(drafted=2, kept=2, tokens=3, seconds=0.01)  # fewer drafted than asked (a short draft)
        assert p.gamma == 6 and p.attempted == []  # the old rule: gamma + 1; nothing counted


def test_engine_blocks_stay_under_the_cap_of_its_curve_and_stay_exact():
    target = tiny_model("llama", n_layers=2, seed=40)
    prompt = list(range(3, 20))

    def run(curve):
        eng = Engine(FastModel(target, max_len=256), TinyTokenizer(),
                     drafter=ModelDrafter(FastModel(target, max_len=256, name="draft"), 256))  # always right
        eng.verify_curve = curve
        sd = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=60, gamma=5, min_confidence=0.0))
        eng.reset()
        return sd, eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=60, gamma=5, adaptive=False))

    steep = ms({1: 10, 4: 10, 5: 100, 16: 400})  # a pass past 4 tokens costs 10x
    capped, fixed = run(steep)
    free, _ = run(None)
    assert capped.tokens == fixed.tokens == free.tokens
    assert 0 < len(capped.stats.position_attempts) <= 3  # never a block past the step
    assert len(free.stats.position_attempts) > 3  # without the curve the block grows past it
