"""Greedy equivalence (fp32): sd and exact are token-identical to ar and to transformers' generate().

As in transformers' assisted-decoding tests: a draft that always agrees (the target itself)
and one that almost never does (random weights), several gammas, several seeds, and an EOS
token that falls inside a block.
"""

import pytest
import torch

from conftest import FAMILIES, TinyTokenizer, positions_run, record_forward, tiny_model
from support.engine_cases import NEW, hf_greedy, make_engine, prompt_for
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_kind", ["self", "random"])
def test_sd_equals_ar_equals_transformers(family, draft_kind):
    target = tiny_model(family, seed=11)
    draft = target if draft_kind == "self" else tiny_model(family, n_layers=1, seed=99)
    for seed in range(3):
        prompt = prompt_for(seed)
        reference = hf_greedy(target, prompt, NEW, eos=None)
        ar = make_engine(target).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        assert ar.tokens == reference
        for gamma in (1, 3, 6):
            eng = make_engine(target, draft_model=draft)
            sd = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma, adaptive=seed == 2))
            assert sd.tokens == reference, (family, draft_kind, seed, gamma)
            if draft_kind == "self":  # everything accepted: gamma + 1 tokens per target pass
                assert sd.stats.acceptance_rate == 1.0
                if seed != 2:  # fixed gamma
                    assert sd.stats.target_passes == -(-(NEW - 1) // (gamma + 1)) + ((NEW - 1) % (gamma + 1) == 0)
            else:
                assert sd.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eos_inside_a_block_stops_exactly_like_transformers(family):
    target = tiny_model(family, seed=12)
    prompt = prompt_for(7)
    free = hf_greedy(target, prompt, NEW)
    eos = free[17]  # a token the model emits mid-way; choose it as EOS
    reference = hf_greedy(target, prompt, NEW, eos=eos)
    assert reference[-1] == eos and len(reference) <= 18
    for gamma in (4, 7):
        eng = make_engine(target, draft_model=target, eos=(eos,))
        out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma, adaptive=False))
        assert out.tokens == reference
        assert out.finish_reason == "eos"
        # The whole block was accepted past the EOS: the engine must not keep those tokens.
        assert eng.tokens == prompt + reference


def test_ngram_draft_is_exact_and_accepts_repetitions():
    target = tiny_model("llama", seed=13)
    base = prompt_for(3, 8)
    prompt = base * 3  # repeated text: prompt lookup has something to find
    reference = hf_greedy(target, prompt, NEW)
    out = make_engine(target, ngram=True).generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4))
    assert out.tokens == reference
    assert out.stats.draft_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_multitier_equals_ar(family):
    target = tiny_model(family, n_layers=6, seed=14)
    draft = tiny_model(family, n_layers=1, seed=98)
    for seed in range(2):
        prompt = prompt_for(seed + 20)
        reference = hf_greedy(target, prompt, NEW)
        for draft_model in (target, draft):
            eng = make_engine(target, draft_model=draft_model, slim_layers=[0, 2, 3, 5])
            out = eng.generate(prompt, GenerationConfig(mode="exact", max_new_tokens=NEW, gamma=4))
            assert out.tokens == reference
            assert out.stats.slim_passes > 0


def test_multi_turn_cache_reuse_matches_fresh_processing():
    target = tiny_model("qwen2", seed=15)
    eng = make_engine(target, draft_model=tiny_model("qwen2", n_layers=1, seed=97))
    calls = record_forward(eng.target)
    turn1 = prompt_for(1)
    first = eng.generate(turn1, GenerationConfig(mode="sd", max_new_tokens=15))
    assert (first.stats.prefill_cached, first.stats.prefill_processed) == (0, len(turn1))
    assert calls[0] == (0, len(turn1) - 1)  # the prefill pass: every prompt position but the last
    history = turn1 + first.tokens + prompt_for(2, 5)
    calls.clear()
    second = eng.generate(history, GenerationConfig(mode="sd", max_new_tokens=15))
    fresh = make_engine(target).generate(history, GenerationConfig(mode="ar", max_new_tokens=15))
    assert second.tokens == fresh.tokens
    # The cache held turn 1's prompt and answer except the answer's last token (never fed back).
    cached = len(turn1) + len(first.tokens) - 1
    # What the target's forward ran for prompt positions: from the first cached-out position to
    # the end of the prompt, each position once; nothing before it again, nothing skipped.
    ran = positions_run(calls, len(history))
    assert sorted(ran) == list(range(cached, len(history))), calls[:3]
    assert calls[0] == (cached, len(history) - 1 - cached)  # one prefill pass over the new positions
    assert (second.stats.prefill_cached, second.stats.prefill_processed) == (cached, len(set(ran)))


def test_budget_and_stats_are_consistent():
    target = tiny_model("llama", seed=16)
    out = make_engine(target, draft_model=target).generate(prompt_for(4), GenerationConfig(mode="sd", max_new_tokens=23, gamma=5, adaptive=False))
    s = out.stats
    assert len(out.tokens) == 23 == s.new_tokens
    assert out.finish_reason == "length"
    assert sum(s.accepted_lengths) >= s.new_tokens  # the last block may be cut by the budget
    assert s.target_passes == len(s.accepted_lengths)
    assert s.mean_accepted_length == pytest.approx(23 / s.target_passes)
    assert s.position_attempts[0] == s.steps
    assert s.time_prefill < s.time_first_token <= s.time_total  # the first token comes after the prefill's pass


def test_hybrid_draft_is_exact_and_uses_both_sources():
    from viasd_core.speculation.hybrid_drafter import HybridDrafter

    target = tiny_model("llama", seed=17)
    draft = tiny_model("llama", n_layers=1, seed=96)
    base = prompt_for(5, 8)
    prompt = base * 2 + prompt_for(6, 6)
    reference = hf_greedy(target, prompt, NEW)
    hybrid = HybridDrafter(ModelDrafter(FastModel(draft, max_len=128), 256))
    calls = {"model": 0}
    inner = hybrid.model_drafter.propose

    def counting(*a, **k):
        calls["model"] += 1
        return inner(*a, **k)

    hybrid.model_drafter.propose = counting
    eng = Engine(FastModel(target, max_len=128), TinyTokenizer(), drafter=hybrid)
    for gamma in (3, 5):
        eng.reset()
        calls["model"] = 0
        out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma))
        assert out.tokens == reference
        assert 0 < calls["model"] < out.stats.steps  # the model drafted some blocks, lookup the others


def test_should_stop_ends_the_generation_and_keeps_the_caches_consistent():
    target = tiny_model("llama", seed=11)
    prompt = prompt_for(0)
    eng = make_engine(target, draft_model=target)
    asked = []

    def stop_after_two_steps():
        asked.append(1)
        return len(asked) >= 2

    out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3, adaptive=False),
                       should_stop=stop_after_two_steps)
    assert out.finish_reason == "cancelled"
    assert len(asked) == 2 and out.stats.steps == 2
    assert len(out.tokens) == 8  # two fully accepted blocks of 3 drafted + 1 bonus token
    # The next request continues from a consistent state: same tokens as a fresh engine.
    full = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3, adaptive=False))
    fresh = make_engine(target).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
    assert full.tokens == fresh.tokens and full.tokens[:8] == out.tokens


def test_a_float16_overflow_ends_the_generation_with_an_error_and_no_read_per_pass():
    """Non-finite logits in float16 are flagged on the device by every pass and read once, at the
    end of the generation (a read per pass would synchronize a GPU at every step)."""
    from viasd_core.errors import ViasdError

    target = tiny_model("llama", seed=11).half()
    prompt = prompt_for(0)
    eng = make_engine(target, draft_model=target)
    out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=8, gamma=3, adaptive=False))
    assert out.stats.steps == eng.host_reads  # healthy: no error, one read a step
    with torch.no_grad():
        target.lm_head.weight.mul_(1e4)  # logits beyond float16's range
    eng = make_engine(target, draft_model=target)
    with pytest.raises(ViasdError, match="overflowed in float16"):
        eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=8, gamma=3, adaptive=False))
    assert 1 <= eng.host_reads <= 8  # the steps ran to the end, one read each: no read per pass
