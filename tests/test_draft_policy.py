"""The draft-length policy: the block length with the most expected tokens per second, from measured
acceptance and step costs; plain steps while drafting does not pay."""

import random

from conftest import TinyTokenizer, tiny_model
from viasd_core.decoding.draft_policy import FIRST_PRIOR, DraftPolicy
from viasd_core.decoding.drafters import ModelDrafter
from viasd_core.decoding.engine import Engine, GenerationConfig
from viasd_core.decoding.model import FastModel


def test_acceptance_per_depth_with_priors_and_the_expected_tokens():
    p = DraftPolicy(gamma=3, gamma_max=5, decay=1.0)
    assert p.acceptance() == [FIRST_PRIOR] * 5 and p.expected_tokens(0) == 1.0
    p.record_spec(asked=3, kept=3, seconds=1.0)
    p.record_spec(asked=3, kept=1, seconds=1.0)
    p.record_spec(asked=2, kept=0, seconds=1.0)
    a = p.acceptance()
    assert a[0] == (2 + FIRST_PRIOR) / 4  # due 3 times, accepted twice, shrunk toward 1/2
    assert a[1] == (1 + a[0]) / 3  # due twice (token 1 was rejected in the third step), accepted once
    assert a[2] == (1 + a[1]) / 2  # due once (the first step), accepted
    assert a[3] == a[2] and a[4] == a[2]  # never due: the depth before
    assert p.expected_tokens(2) == 1 + a[0] + a[0] * a[1]
    p.record_spec(asked=1, kept=0, seconds=1.0)  # nothing proposed (or stopped at once): a rejection
    assert p.acceptance()[0] == (2 + FIRST_PRIOR) / 5 and p.acceptance()[1] == (1 + p.acceptance()[0]) / 3


def test_cost_is_measured_or_priced_on_the_measured_line():
    p = DraftPolicy(gamma=4, gamma_max=8, decay=1.0)
    assert p.cost(2) is None  # nothing measured
    p.record_spec(asked=4, kept=0, seconds=0.030)
    p.record_spec(asked=4, kept=0, seconds=0.034)
    assert p.cost(4) == 0.032 and p.cost(2) is None  # one width: no line yet
    p.record_plain(seconds=0.016)
    assert p.cost(0) == 0.016
    assert abs(p.cost(2) - 0.024) < 1e-12  # between 0 and 4
    assert abs(p.cost(6) - 0.040) < 1e-12  # beyond: the slope of the two widest
    q = DraftPolicy(gamma=4, gamma_max=8, decay=1.0)
    q.record_plain(0.02)
    q.record_spec(4, 0, 0.01)  # a cheaper block than a plain step (noise): never cheaper beyond it
    assert q.cost(6) == 0.01
    r = DraftPolicy(gamma=4, gamma_max=8, decay=0.5)  # decayed means weigh the recent steps more
    r.record_plain(0.04)
    r.record_plain(0.01)
    assert r.cost(0) == (0.5 * 0.04 + 0.01) / 1.5


def simulate(cost, accept, steps=400, seed=0, **kw):
    """Drive a policy with a synthetic machine: a step drafting g costs cost(g) seconds and each
    drafted token is accepted with chance `accept` (given the ones before). Returns the policy and
    the block lengths it chose."""
    rng = random.Random(seed)
    p = DraftPolicy(gamma=5, gamma_max=12, **kw)
    chosen = []
    for _ in range(steps):
        g = p.block_length()
        chosen.append(g)
        if g == 0:
            p.record_plain(cost(0))
            continue
        kept = 0
        while kept < g and rng.random() < accept:
            kept += 1
        p.record_spec(g, kept, cost(g))
    return p, chosen


def true_rate(g, cost, accept):
    return sum(accept ** i for i in range(g + 1)) / cost(g)


def test_the_choice_follows_this_machines_curve_and_the_drafts_acceptance():
    cases = {  # (cost curve, acceptance) -> the block lengths within 5% of the best true rate
        "gpu: a wide pass costs what a narrow one does": (lambda g: 0.010 + 0.0002 * g, 0.8),
        "cpu: each drafted token adds a third of a plain step": (lambda g: 0.016 * (1 + g / 3), 0.7),
        "a weak draft on a cpu: plain steps": (lambda g: 0.016 * (1 + g / 2), 0.3),
    }
    for name, (cost, accept) in cases.items():
        rates = {g: true_rate(g, cost, accept) for g in range(13)}
        best = max(rates.values())
        good = {g for g, r in rates.items() if r >= 0.95 * best}
        _, chosen = simulate(cost, accept)
        late = chosen[200:]
        share = sum(g in good for g in late) / len(late)
        assert share >= 0.75, (name, good, late[:40])
    # the three machines end up with different blocks: long, short, none
    assert max(simulate(*cases["gpu: a wide pass costs what a narrow one does"])[1][200:]) >= 6
    cpu = simulate(*cases["cpu: each drafted token adds a third of a plain step"])[1][200:]
    assert 1 <= sorted(cpu)[len(cpu) // 2] <= 3
    weak = simulate(*cases["a weak draft on a cpu: plain steps"])[1][200:]
    assert weak.count(0) >= 0.6 * len(weak)


def test_plain_steps_probe_drafting_again():
    p = DraftPolicy(gamma=4, gamma_max=8, probe_every=3, decay=0.5)
    assert p.block_length() == 4
    p.record_spec(asked=4, kept=0, seconds=0.05)
    assert p.block_length() == 4  # the first length twice,
    p.record_spec(asked=4, kept=0, seconds=0.05)
    assert p.block_length() == 0  # then a plain step
    p.record_plain(seconds=0.02)
    for run in (1, 2):  # drafting costs more and emits nothing: plain steps
        assert p.plain_run == run and p.block_length() == 0
        p.record_plain(0.02)
    assert p.plain_run == 3 and p.block_length() == 1  # after 3 plain steps, the best block is tried
    p.record_spec(asked=1, kept=1, seconds=0.021)  # and it paid
    assert p.plain_run == 0 and p.block_length() >= 1


def test_fixed_gamma_is_kept():
    p = DraftPolicy(gamma=5, gamma_max=9, adaptive=False)
    for _ in range(4):
        p.record_spec(asked=5, kept=0, seconds=1.0)
        p.record_plain(0.001)
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


def test_the_engine_keeps_its_measurements_across_generations_of_one_kind():
    target = tiny_model("llama", n_layers=2, seed=42)
    draft = tiny_model("llama", n_layers=1, seed=43)
    eng = Engine(FastModel(target, max_len=256), TinyTokenizer(),
                 drafter=ModelDrafter(FastModel(draft, max_len=256, name="draft"), 256))
    prompt = list(range(3, 20))
    config = GenerationConfig(mode="sd", max_new_tokens=24, gamma=3)
    eng.generate(prompt, config)
    (policy,) = eng._policies.values()
    assert policy.spec_steps >= 2 and policy.steps.get(0)  # the first generation measured both kinds
    seconds = dict(policy.seconds)
    eng.reset()
    eng.generate(prompt, config)
    assert list(eng._policies.values()) == [policy] and policy.seconds != seconds  # the same one, measuring on
    eng.reset()
    eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=24, gamma=3, min_confidence=0.0))
    eng.reset()
    eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=24, gamma=3, adaptive=False))
    assert len(eng._policies) == 2  # another stop rule: another policy; --fixed keeps none
