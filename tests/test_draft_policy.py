"""The draft-length policy: block length from acceptance, plain steps while drafting does not pay."""

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


# ---------------------------------------------------------------------- block length from measured costs
# A CPU's verify curve as measured for the shipped pair at int4 (2 threads, ms -> s): each row costs
CPU_CURVE = {1: 0.0184, 2: 0.0197, 3: 0.0225, 4: 0.0252, 6: 0.0376, 8: 0.0404, 11: 0.0536, 16: 0.0697}
FLAT_CURVE = {1: 0.010, 16: 0.0104}  # a GPU's: 16 tokens cost about what 1 does


def test_expected_tokens_is_one_plus_the_chance_of_each_prefix():
    from viasd_core.decoding.draft_policy import expected_tokens

    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0  # nothing past a sure rejection


def test_measured_costs_choose_the_block_of_most_expected_tokens_per_second():
    from viasd_core.decoding.draft_policy import BlockCosts

    weak = (0.359, 0.105, 0.081, 0.056, 0.030)  # the probe's P(tokens 1..i accepted), shipped head
    p = DraftPolicy(gamma=5, gamma_max=12, costs=BlockCosts(CPU_CURVE, 0.0019, weak))
    # rate(1) = 1.359 / (0.0019 + 0.0197) = 62.9/s; rate(2) = 1.464 / (0.0038 + 0.0225) = 55.7/s
    assert p.gamma == 1 and abs(p.rate(1) - 1.359 / 0.0216) < 1e-9 and p.rate(2) < p.rate(1)
    strong = tuple(0.9 ** i for i in range(1, 6))
    q = DraftPolicy(gamma=5, gamma_max=12, costs=BlockCosts(FLAT_CURVE, 0.0001, strong))
    assert q.gamma == 12  # nearly free width and a draft that is mostly right: the longest block
    r = DraftPolicy(gamma=5, gamma_max=12, costs=BlockCosts(CPU_CURVE, 0.0001, strong))
    # The same draft on the CPU: 1 + 0.9 + ... + 0.9^g tokens over g drafts and a (g + 1)-wide pass.
    # The curve is nearly flat from width 6 to 8 and steep after: 7 drafted tokens (width 8).
    by_hand = {g: sum(0.9 ** i for i in range(g + 1)) / (g * 0.0001 + verify) for g, verify in
               ((1, 0.0197), (2, 0.0225), (3, 0.0252), (5, 0.0376), (7, 0.0404), (10, 0.0536), (12, 0.0536 + 0.0161 * 2 / 5))}
    assert r.gamma == 7 == max(by_hand, key=by_hand.get)
    assert all(abs(r.rate(g) - rate) < 1e-9 * rate for g, rate in by_hand.items())


def test_measured_acceptance_moves_the_block_length_from_the_probes_start():
    from viasd_core.decoding.draft_policy import PRIOR_WEIGHT, BlockCosts

    p = DraftPolicy(gamma=5, gamma_max=8, decay=1.0, costs=BlockCosts(CPU_CURVE, 0.0019, (0.3, 0.09)))
    assert p.gamma == 1
    assert p.acceptance()[:3] == [0.3, 0.3, 0.3]  # the prior's conditional shares, the last one carried on
    for _ in range(12):  # the text turns easy: every drafted token accepted
        p.record_spec(drafted=p.gamma, kept=p.gamma, tokens=p.gamma + 1, seconds=0.02)
    a = p.acceptance()
    assert a[0] == (12 + PRIOR_WEIGHT * 0.3) / (12 + PRIOR_WEIGHT)  # measured and prior, counted together
    assert p.gamma == 3  # width 4: the last width before the curve steps up at 5
    p.record_plain(tokens=1, seconds=0.02)  # the measured guard: drafting (39 tokens / 0.24 s) pays
    assert p.block_length() == 3
    for _ in range(40):  # and hard again: the first token always rejected
        p.record_spec(drafted=p.gamma, kept=0, tokens=1, seconds=0.02)
    assert p.gamma == 1
    assert p.reached[1] < p.reached[0]  # a block rejected at its first token never reaches its second


def test_fixed_blocks_ignore_measured_costs():
    from viasd_core.decoding.draft_policy import BlockCosts

    p = DraftPolicy(gamma=4, gamma_max=8, adaptive=False, costs=BlockCosts(CPU_CURVE, 0.0019, (0.3,)))
    p.record_spec(drafted=4, kept=0, tokens=1, seconds=1.0)
    assert p.block_length() == 4


def test_tree_choice_hands_its_chain_measurements_to_the_block_policy():
    from viasd_core.tree_choice import TreeChoice

    options = [{"name": "plain", "shape": None, "width": 1, "tau": 1.0, "draft_seconds": 0.0},
               {"name": "chain of 1", "shape": None, "width": 2, "tau": 1.4, "draft_seconds": 0.002},
               {"name": "chain of 2", "shape": None, "width": 3, "tau": 1.55, "draft_seconds": 0.004},
               {"name": "tree of 5", "shape": {"topk": 2, "depth": 4, "size": 5}, "width": 6, "tau": 1.7,
                "draft_seconds": 0.01}]
    costs = TreeChoice(None, "auto: chain of 1", options, CPU_CURVE).block_costs()
    assert costs.draft_seconds == 0.002 and costs.verify_seconds == CPU_CURVE
    assert [round(x, 9) for x in costs.prior] == [0.4, 0.15]
    assert TreeChoice(None, "--tree off", [], {}).block_costs() is None


def test_engine_drafts_the_measured_length_and_stays_exact():
    from viasd_core.decoding.draft_policy import BlockCosts

    target = tiny_model("llama", n_layers=4, seed=40)
    eng = Engine(FastModel(target, max_len=256), TinyTokenizer(),
                 drafter=ModelDrafter(FastModel(target, max_len=256, name="draft"), 256))  # the target: always right
    prompt = list(range(3, 20))
    ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24)).tokens
    costs = BlockCosts({1: 0.01, 3: 0.011, 4: 0.03, 16: 0.2}, 0.0001, (0.9, 0.81))  # width 3 cheap, 4 not
    out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=24, block_costs=costs, min_confidence=0.0))
    assert out.tokens == ar
    s = out.stats
    # blocks of 2 (width 3), and every 4th block one more to measure the third position
    assert len(s.position_attempts) == 3 and 0 < 2 * s.position_attempts[2] < s.position_attempts[0]
