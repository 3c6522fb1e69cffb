"""The draft-length policy: block length from acceptance, plain steps while drafting clearly does not pay."""

import pytest

from conftest import TinyTokenizer, tiny_model
from viasd_core.speculation.draft_policy import FLOOR, PLAIN_MARGIN, SPEC_FIRST, UNMEASURED_START, DraftPolicy
from viasd_core.machine.first_block import first_block
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.errors import UsageError


def test_block_length_follows_acceptance():
    p = DraftPolicy(gamma=3, gamma_max=5)
    p.record_spec(drafted=3, kept=3, tokens=4, seconds=1.0)
    assert p.gamma == 4
    p.record_spec(drafted=4, kept=1, tokens=2, seconds=1.0)  # something kept: unchanged
    assert p.gamma == 4
    p.record_spec(drafted=4, kept=0, tokens=1, seconds=1.0)  # nothing kept: one fewer
    assert p.gamma == 3
    for _ in range(5):
        p.record_spec(drafted=p.gamma, kept=0, tokens=1, seconds=1.0)
    assert p.gamma == FLOOR == 2  # never below the floor
    for _ in range(5):
        p.record_spec(drafted=p.gamma, kept=p.gamma, tokens=p.gamma + 1, seconds=1.0)
    assert p.gamma == 5  # capped
    one = DraftPolicy(gamma=1, gamma_max=5)  # started below the floor: not raised by a rejection
    one.record_spec(drafted=1, kept=0, tokens=1, seconds=1.0)
    assert one.gamma == 1


def test_plain_steps_need_a_margin():
    """Plain steps only where they measure PLAIN_MARGIN faster: the decayed rates are noisy."""
    p = DraftPolicy(gamma=3, gamma_max=8, decay=1.0, spec_first=2)
    p.record_spec(3, 1, 2, 0.02)
    p.record_spec(3, 1, 2, 0.02)  # 100 tokens/s drafting
    assert p.block_length() == 0  # measure a plain step once
    p.record_plain(1, 1 / (100 * (1 + PLAIN_MARGIN) - 5))  # faster, but within the margin
    assert p.block_length() == 3
    p.record_plain(1, 1 / (100 * (1 + PLAIN_MARGIN) + 10))  # now clearly faster on the running sums
    assert p.plain_rate > p.spec_rate * (1 + PLAIN_MARGIN) and p.block_length() == 0


def test_plain_steps_while_drafting_does_not_pay_and_probes_again():
    p = DraftPolicy(gamma=4, gamma_max=8, probe_every=3, decay=0.5, spec_first=2)
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


def test_a_measured_first_block_is_also_the_floor():
    config = GenerationConfig(mode="sd")
    config.start_at_measured(3)
    assert (config.gamma, config.gamma_floor) == (3, 3)
    p = DraftPolicy(config.gamma, config.gamma_max, floor=config.gamma_floor)
    p.record_spec(drafted=3, kept=0, tokens=1, seconds=1.0)
    assert p.gamma == 3  # an empty block: no shorter than the measured length
    p.record_spec(drafted=3, kept=3, tokens=4, seconds=1.0)
    p.record_spec(drafted=4, kept=0, tokens=1, seconds=1.0)
    assert p.gamma == 3  # grown after a full block, back down to the floor, not below
    plain = DraftPolicy(config.gamma, config.gamma_max)
    plain.record_spec(drafted=3, kept=0, tokens=1, seconds=1.0)
    assert plain.gamma == FLOOR == 2  # -g given: the floor of 2
    bad = GenerationConfig(mode="sd", gamma_floor=0)
    with pytest.raises(UsageError, match="block floor"):
        bad.validate()


def test_a_plain_step_is_measured_only_after_spec_first_speculative_steps():
    p = DraftPolicy(gamma=3, gamma_max=8)
    for step in range(SPEC_FIRST):
        assert p.block_length() == p.gamma, step  # the first blocks are noisy: no plain step yet
        p.record_spec(drafted=p.gamma, kept=0, tokens=1, seconds=1.0)
    assert p.spec_steps == SPEC_FIRST and p.block_length() == 0


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
    # most steps drafted nothing (the old +1/-1 rule drafted at least one token every step): after
    # the first SPEC_FIRST blocks, plain steps with a block every probe_every + 1 steps
    drafting = sd.stats.position_attempts[0]  # steps whose block held a first draft
    assert SPEC_FIRST <= drafting < 0.5 * sd.stats.steps, (drafting, sd.stats.steps)


def test_the_first_block_is_the_measured_chain_within_the_floor_and_the_cap():
    assert first_block(None, 12) == (UNMEASURED_START, "not measured here (--tree auto's probe did not run)")
    assert first_block(None, 3)[0] == 3
    assert first_block(3, 12) == (3, "the probe's fastest chain on this machine is 3 drafts")
    start, why = first_block(1, 12)
    assert start == FLOOR and "raised to the floor" in why
    start, why = first_block(5, 4)
    assert start == 4 and "held to 4" in why
