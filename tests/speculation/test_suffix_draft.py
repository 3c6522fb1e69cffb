"""Drafts that remember (docs/drafts.md): the counted suffix index, the suffix drafter alone and beside a
draft model, their exactness (sd == ar whatever they propose), and the statistics a step records of who
drafted it."""

import random

import pytest
import torch

from conftest import TinyTokenizer, tiny_model
from viasd_core.speculation.draft_policy import DraftPolicy
from viasd_core.speculation.drafters import ModelDrafter, NgramDrafter
from viasd_core.speculation.hybrid_drafter import HybridDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.stats import NO_DRAFT
from viasd_core.speculation.suffix_drafter import SuffixDrafter
from viasd_core.speculation.suffix_index import MAX_NEXT, SuffixIndex, Walk

NEW = 40


def prompt_for(seed, length=12):
    g = torch.Generator().manual_seed(200 + seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def engine_with(target, drafter):
    return Engine(FastModel(target, max_len=160), TinyTokenizer(), drafter=drafter)


# ---------------------------------------------------------------------- the index
def test_index_proposes_the_continuation_of_a_repeated_span():
    index = SuffixIndex(max_order=4, min_order=2)
    text = [10, 11, 12, 13, 14, 15, 16, 99, 98, 11, 12]
    index.add(text)
    walk = index.walk(text, limit=4)
    assert walk.tokens == [13, 14, 15, 16] and walk.probs == [1.0] * 4 and walk.expected == 4.0
    assert index.walk(text, limit=2).tokens == [13, 14]  # never past the block limit
    assert index.walk([50, 51], limit=4).tokens == []  # a context never seen: nothing
    # Counting: after (1, 2) came 3 twice and 4 once: 3 is proposed, with its frequency
    counted = SuffixIndex(max_order=2, min_order=2)
    counted.add([1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0])
    walk = counted.walk([7, 1, 2], limit=1)
    assert walk.tokens == [3] and walk.probs == [pytest.approx(2 / 3)]
    # the walk stops before the product of frequencies falls below min_prob
    assert counted.walk([7, 1, 2], limit=1, min_prob=0.7).tokens == []


def test_expected_accepted_length_is_the_sum_of_prefix_products():
    assert Walk([1, 2, 3], [0.5, 0.5, 1.0]).expected == pytest.approx(0.5 + 0.25 + 0.25)
    assert Walk([], []).expected == 0.0


def test_index_memory_is_bounded():
    rng = random.Random(0)
    index = SuffixIndex(max_order=6, min_order=2, max_entries=300)
    for _ in range(5):
        index.add([rng.randrange(40) for _ in range(2000)])
        assert len(index) <= 300
    assert all(len(counts) <= MAX_NEXT for counts in index.table.values())
    # one context followed by many different tokens keeps MAX_NEXT of them, the most counted among them
    busy = SuffixIndex(max_order=2, min_order=2)
    busy.add([t for nxt in [5] * 3 + list(range(100, 120)) for t in (1, 2, nxt)])
    (counts,) = [c for c in busy.table.values() if 5 in c]
    assert len(counts) == MAX_NEXT and counts[5] == 3
    # the contexts updated last survive
    index.add([1, 2, 3, 4, 5, 6, 7])
    assert index.walk([1, 2, 3], limit=3).tokens == [4, 5, 6]


def test_suffix_drafter_learns_across_requests_and_forget_drops_it():
    drafter = SuffixDrafter()
    first = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    assert drafter.match(first, 4).tokens == []  # nothing repeats within it
    drafter.reset()  # a new request: the conversation is gone, the history stays
    assert len(drafter.conversation) == 0 and len(drafter.history) > 0
    second = [90, 91, 22, 23]
    walk = drafter.match(second, 4)
    assert walk.tokens == [24, 25, 26, 27]
    drafter.forget()
    assert drafter.match([90, 91, 22, 23], 4).tokens == []


def test_a_rewritten_conversation_is_reindexed_the_history_keeps_the_old_text():
    drafter = SuffixDrafter()
    drafter.match([1, 2, 3, 4, 5, 6], 3)
    drafter.rollback(2)  # a new prompt shares the first two tokens only
    walk = drafter.match([1, 2, 9, 9, 2, 3], 3)
    assert walk.tokens == [4, 5, 6]  # from the history: what followed (2, 3) in the earlier request
    assert drafter.conversation.walk([2, 3], 3).tokens == []  # not in this conversation any more
    assert drafter.tokens == [1, 2, 9, 9, 2, 3]
    assert drafter.conversation.walk([9, 9], 1).tokens == [2]


def test_ngram_match_is_prompt_lookup_as_before():
    ngram = NgramDrafter()
    walk = ngram.match([5, 6, 7, 8, 5, 6], 3)
    assert walk.tokens == [7, 8, 5] and walk.expected == 3.0


# ---------------------------------------------------------------------- exactness
def test_sd_with_the_suffix_drafter_equals_ar_and_remembers_earlier_requests():
    target = tiny_model("llama", seed=21)
    prompt = prompt_for(1)
    ar = engine_with(target, None).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
    eng = engine_with(target, SuffixDrafter())
    runs = []
    for gamma in (3, 5):
        for _ in range(2):  # the second run of a prompt finds the first one's answer in the history
            out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma, adaptive=False))
            assert out.tokens == ar.tokens, gamma
            runs.append(out.stats)
            eng.reset()
        eng.drafter.forget()
    first, again, forgotten = runs[0], runs[1], runs[2]
    assert again.draft_sources.get("suffix", 0) > first.draft_sources.get("suffix", 0)
    assert again.target_passes <= NEW // 3 < first.target_passes
    fresh = engine_with(target, SuffixDrafter()).generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=5,
                                                                                  adaptive=False)).stats
    assert (forgotten.target_passes, forgotten.draft_sources) == (fresh.target_passes, fresh.draft_sources)
    # a repeated prompt: the conversation alone proposes too, and sd stays exact
    repeated = prompt_for(2, 8) * 3
    reference = engine_with(target, None).generate(repeated, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    out = engine_with(target, SuffixDrafter()).generate(repeated, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4))
    assert out.tokens == reference and out.stats.draft_sources.get("suffix", 0) > 0


def test_hybrid_with_the_suffix_index_is_exact_and_chooses_by_expected_length():
    target = tiny_model("llama", seed=22)
    draft = tiny_model("llama", n_layers=1, seed=95)
    prompt = prompt_for(4, 6) + prompt_for(3, 8) * 2 + prompt_for(3, 3)  # it ends inside a repeat
    reference = engine_with(target, None).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    hybrid = HybridDrafter(ModelDrafter(FastModel(draft, max_len=160, name="draft"), 256), SuffixDrafter())
    eng = engine_with(target, hybrid)
    out = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4))
    assert out.tokens == reference
    sources = out.stats.draft_sources
    assert sources.get("model", 0) > 0 and sources.get("suffix", 0) > 0
    per_source = out.stats.source_tokens  # [drafted, kept] per source: together, every block position
    assert set(per_source) == {"model", "suffix"}
    assert [sum(v[i] for v in per_source.values()) for i in (0, 1)] == [sum(out.stats.position_attempts),
                                                                         sum(out.stats.position_accepts)]
    # The model's kept tokens are learned from the rollback after each of its proposals; a suffix walk
    # proposes only where it expects at least as many (and min_match)
    hybrid.pending = (10, 4)
    hybrid.kept_sum = hybrid.kept_count = 0.0
    hybrid.rollback(13)
    assert hybrid.model_kept == 3.0 and hybrid.pending is None
    assert not hybrid._lookup_wins(Walk([1, 2, 3, 4], [1.0, 1.0, 0.5, 0.5]))  # expected 2.75 < 3
    assert hybrid._lookup_wins(Walk([1, 2, 3, 4], [1.0, 1.0, 1.0, 0.5]))  # expected 3.5
    ngram_side = HybridDrafter(hybrid.model_drafter)  # prompt lookup: its copy's length against min_match only
    ngram_side.kept_sum, ngram_side.kept_count = 9.0, 1.0
    assert ngram_side._lookup_wins(Walk([1, 2], [1.0, 1.0])) and not ngram_side._lookup_wins(Walk([1], [1.0]))


# ---------------------------------------------------------------------- who drafted each step
def test_steps_are_counted_by_kind_and_sum_to_the_steps(monkeypatch):
    """Every other step the policy asks no draft (forced here): those are counted plain, the others by
    who proposed (or none), and the counts sum to the steps."""
    target = tiny_model("llama", seed=23)
    calls = {"n": 0}

    def every_other(self):
        calls["n"] += 1
        return 0 if calls["n"] % 2 == 0 else self.gamma

    monkeypatch.setattr(DraftPolicy, "block_length", every_other)
    prompt = prompt_for(5, 8) * 2
    reference = engine_with(target, None).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    drafter = SuffixDrafter()
    proposed = {"n": 0}
    inner = drafter.propose

    def counting(*a, **k):
        proposed["n"] += 1
        return inner(*a, **k)

    drafter.propose = counting
    out = engine_with(target, drafter).generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3))
    s = out.stats
    assert out.tokens == reference
    assert s.steps == calls["n"] and sum(s.draft_sources.values()) == proposed["n"]
    # the policy's plain steps, and at most one more: a last step with one token of the budget left
    assert s.policy_plain_steps - calls["n"] // 2 in (0, 1)
    assert set(s.draft_sources) == {"suffix", NO_DRAFT}  # the repeat is found, the first steps find nothing
    assert s.position_attempts[0] == s.draft_sources["suffix"]  # every proposing step drafted position 0
    assert s.source_tokens == {"suffix": [sum(s.position_attempts), sum(s.position_accepts)]}
    ar = engine_with(target, None).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).stats
    assert ar.policy_plain_steps == ar.steps == NEW and ar.draft_sources == {}


# ---------------------------------------------------------------------- --draft and viasd bench --breakdown
def test_draft_names_select_the_suffix_index_alone_and_beside_a_model(tiny_dirs, viasd_home):
    from viasd_core.loading.options import ModelOptions
    from viasd_core.session import build_session

    alone = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft="suffix"), mode="sd")
    assert isinstance(alone.engine.drafter, SuffixDrafter) and alone.draft_id == "suffix"
    beside = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=f"{tiny_dirs['draft']}+suffix"), mode="sd")
    d = beside.engine.drafter
    assert isinstance(d, HybridDrafter) and isinstance(d.lookup, SuffixDrafter) and isinstance(d.model_drafter, ModelDrafter)
    assert beside.draft_id.endswith("+suffix")


def test_bench_breakdown_per_category_counts_sum_to_the_steps(tiny_dirs, viasd_home, tmp_path):
    import json

    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    prompts = tmp_path / "spec.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in (
        {"question_id": 1, "category": "writing", "turns": ["w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"]},
        {"question_id": 2, "category": "coding", "turns": ["w9 w8 w7 w9 w8 w7 w9"]})))
    out = tmp_path / "run"
    r = CliRunner().invoke(get_app(), ["bench", "-m", str(tiny_dirs["target"]), "-d", f"{tiny_dirs['draft']}+suffix",
                                       "--prompts", str(prompts), "-n", "12", "--device", "cpu", "--methods",
                                       "ar,hf,sd", "--breakdown", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.stderr
    assert "Where the tokens are lost" in r.stdout and "Where the time goes" in r.stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    methods = json.loads((out / "summary.json").read_text())["methods"]
    assert methods["hf"]["acceptance_breakdown"] is None  # transformers' runs say nothing of their steps
    sd = methods["sd"]["acceptance_breakdown"]
    assert set(sd["by_category"]) == {"writing", "coding"}
    for cat, b in [("all", sd["all"]), *sd["by_category"].items()]:
        rs = [x for x in rows if x["method"] == "sd" and cat in ("all", x["category"])]
        assert b["steps"] == sum(x["steps"] for x in rs) == sum(b["step_counts"].values()), cat
        assert sum(b["step_shares"].values()) == pytest.approx(1.0)
        assert set(b["step_counts"]) <= {"plain", NO_DRAFT, "model", "suffix"}
        drafted = b["steps"] - b["step_counts"]["plain"] - b["step_counts"][NO_DRAFT]
        assert b["position_attempts"][0] == drafted  # every block that was proposed drafted position 0
        assert b["tokens_per_target_pass"] == pytest.approx(sum(x["new_tokens"] for x in rs) / sum(x["target_passes"] for x in rs))
        assert b["acceptance_by_position"] == pytest.approx([a / t for a, t in zip(b["position_accepts"], b["position_attempts"])])
        assert b["accepted_share_by_position"][0] == pytest.approx(b["position_accepts"][0] / b["steps"])
        drafted_kept = [sum(v[i] for v in b["source_tokens"].values()) for i in (0, 1)]
        assert drafted_kept == [sum(b["position_attempts"]), sum(b["position_accepts"])]
        for source, (d, k) in b["source_tokens"].items():
            assert b["acceptance_by_source"][source] == pytest.approx(k / d)
    assert sd["all"]["step_counts"].get("model", 0) > 0  # the model drafted where the index had nothing
    ar = methods["ar"]["acceptance_breakdown"]["all"]
    assert ar["step_counts"] == {"plain": ar["steps"], NO_DRAFT: 0} and ar["position_attempts"] == []
