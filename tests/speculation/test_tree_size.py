"""`--tree auto`: the cost model on synthetic curves (a CPU-like steep one, a GPU-like flat one),
the option's parsing, and the choice measured once per machine and pair, then read from its cache."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TinyTokenizer, tiny_model
from support.head_cases import make_head
from viasd_core.speculation.drafters import ModelDrafter, NgramDrafter
from viasd_core.speculation.engine import Engine
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.tree import TreeShape
from viasd_core.speculation.tree_size import Option, choose, interpolate
from viasd_core.errors import UsageError
from viasd_core.machine import tree as tree_choice

PROMPTS = [[5, 9, 17, 33, 2, 8], [40, 41, 42, 7, 7, 3, 1]]
CHAIN3 = Option("chain of 3", None, 4, 2.0, 0.004)
TREE7 = Option("tree of 7", TreeShape(2, 5, 7), 8, 2.4, 0.006)
TREE15 = Option("tree of 15", TreeShape(4, 6, 15), 16, 2.9, 0.010)
PLAIN = Option("plain", None, 1, 1.0, 0.0)
OPTIONS = [PLAIN, CHAIN3, TREE7, TREE15]


def steep(per_row: float) -> dict[int, float]:
    """A CPU-like curve: every extra row costs `per_row` of a 1-token pass (20 ms)."""
    return {w: 0.020 * (1 + per_row * (w - 1)) for w in (1, 2, 4, 8, 16)}


def test_interpolation_between_and_past_the_measured_widths():
    curve = {1: 1.0, 4: 4.0, 16: 10.0}
    assert interpolate(curve, 2) == pytest.approx(2.0)
    assert interpolate(curve, 10) == pytest.approx(7.0)
    assert interpolate(curve, 20) == 10.0 and interpolate(curve, 4) == 4.0


def test_a_width_measured_slower_than_a_wider_one_counts_at_the_wider_cost():
    curve = {1: 16.5, 2: 19.1, 3: 31.2, 4: 25.7, 6: 36.6}  # a probe's noisy width 3 (ms)
    assert interpolate(curve, 3) == 25.7 and interpolate(curve, 2) == 19.1
    assert interpolate(curve, 5) == pytest.approx((25.7 + 36.6) / 2)


def test_a_flat_curve_picks_the_widest_tree_and_a_steep_one_a_chain_or_plain():
    assert choose(OPTIONS, steep(0.0)) is TREE15  # a GPU: width is free, tau decides
    assert choose(OPTIONS, steep(0.02)) is TREE7
    assert choose(OPTIONS, steep(0.25)) is CHAIN3
    assert choose(OPTIONS, steep(0.6)) is PLAIN  # a verify row costs more than it brings
    # the rule itself: the most tokens per second, against a brute-force evaluation
    for per_row in (0.0, 0.03, 0.1, 0.3, 1.0):
        curve = steep(per_row)
        rates = {o.name: o.tau / (o.draft_seconds + interpolate(curve, o.width)) for o in OPTIONS}
        assert choose(OPTIONS, curve).name == max(rates, key=rates.get)


def test_the_tree_option_is_parsed_with_a_one_line_error():
    assert tree_choice.parse_tree("AUTO") == "auto" and tree_choice.parse_tree("off") == "off"
    assert tree_choice.parse_tree("7") == 7
    for bad in ("0", "16", "wide", "-3"):
        with pytest.raises(UsageError, match="--tree must be"):
            tree_choice.parse_tree(bad)
    for n in range(1, 16):
        shape = tree_choice.shape_for_size(n)
        assert shape.size == n and shape.candidates >= n


def engine_with_tree_head(head_seed: int = 11):
    target = tiny_model("llama", n_layers=5, seed=11)
    fast = FastModel(target, max_len=256)
    return Engine(fast, TinyTokenizer(), drafter=FeatureDrafter(make_head(target, seed=head_seed, full=True), fast))


def test_a_head_replaced_under_the_same_name_is_measured_again(viasd_home, monkeypatch):
    key = {"target": "tiny", "draft": "head", "format": "none"}
    first = tree_choice.resolve_tree(engine_with_tree_head(), PROMPTS, "auto", key)
    assert "(cached)" not in first.reason

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(tree_choice, "measure_verify_curve", no_measuring)
    assert tree_choice.resolve_tree(engine_with_tree_head(), PROMPTS, "auto", key).reason.endswith("(cached)")
    retrained = engine_with_tree_head(head_seed=12)
    assert retrained.drafter.weights_identity() != engine_with_tree_head().drafter.weights_identity()
    with pytest.raises(AssertionError, match="measured again"):
        tree_choice.resolve_tree(retrained, PROMPTS, "auto", key)


def test_auto_measures_once_then_reads_its_cache(viasd_home, monkeypatch):
    eng = engine_with_tree_head()
    key = {"target": "tiny", "draft": "head", "format": "none"}
    first = tree_choice.resolve_tree(eng, PROMPTS, "auto", key)
    names = [o["name"] for o in first.options]
    assert names[:2] == ["plain", "chain of 1"] and len(names) == 1 + tree_choice.CHAIN + len(tree_choice.CANDIDATE_TREES)
    assert sorted(first.verify_seconds) == list(tree_choice.CURVE_WIDTHS)
    assert all(o["tau"] >= 1.0 for o in first.options)
    best = max(first.options, key=lambda o: o["tokens_per_s"])
    assert (first.shape is None) == (best["shape"] is None) and "auto:" in first.reason
    cached = list((viasd_home / "cache" / "machine").glob("tree-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["target"] == "tiny"

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(tree_choice, "measure_verify_curve", no_measuring)
    again = tree_choice.resolve_tree(eng, PROMPTS, "auto", key)
    assert again.shape == first.shape and again.reason.endswith("(cached)")
    with pytest.raises(AssertionError, match="measured again"):
        tree_choice.resolve_tree(eng, PROMPTS, "auto", key, refresh=True)
    assert tree_choice.resolve_tree(eng, PROMPTS, "off", key).shape is None
    assert tree_choice.resolve_tree(eng, PROMPTS, 10, key).shape == tree_choice.shape_for_size(10)


def test_a_draft_without_trees_has_its_chains_measured(viasd_home):
    target = tiny_model("llama", n_layers=3, seed=12)
    alone = Engine(FastModel(target, max_len=64), TinyTokenizer())
    assert tree_choice.resolve_tree(alone, PROMPTS, "auto", {"target": "tiny"}).reason == "no draft"
    assert not list((viasd_home / "cache").glob("machine/*.json"))  # nothing measured without a draft
    lookup = Engine(FastModel(target, max_len=64), TinyTokenizer(), drafter=NgramDrafter())
    assert tree_choice.resolve_tree(lookup, PROMPTS, "auto", {"target": "tiny"}).reason.startswith("prompt lookup")
    assert not list((viasd_home / "cache").glob("machine/*.json"))  # nor for prompt lookup: it runs no model
    draft = ModelDrafter(FastModel(tiny_model("llama", n_layers=1, seed=13), max_len=64, name="draft"), 256)
    eng = Engine(FastModel(target, max_len=64), TinyTokenizer(), drafter=draft)
    choice = tree_choice.resolve_tree(eng, PROMPTS, "auto", {"target": "tiny"})
    assert choice.shape is None and "grows no trees" in choice.reason
    assert [o["name"] for o in choice.options] == ["plain"] + [f"chain of {g}" for g in range(1, tree_choice.CHAIN + 1)]
    assert 1 <= choice.best_chain() <= tree_choice.CHAIN
    assert tree_choice.resolve_tree(eng, PROMPTS, 5, {"target": "tiny"}).reason == tree_choice.NO_TREES


def test_the_best_chain_is_the_fastest_measured_chain_and_none_unmeasured():
    def option(name, width, rate, shape=None):
        return {"name": name, "shape": shape, "width": width, "tau": 1.0, "draft_seconds": 0.0, "tokens_per_s": rate}

    tree = {"topk": 2, "depth": 4, "size": 5}
    choice = tree_choice.TreeChoice(None, "auto", [option("plain", 1, 300.0), option("chain of 1", 2, 210.0),
                                                   option("chain of 2", 3, 230.0), option("chain of 3", 4, 230.0),
                                                   option("tree of 5", 6, 260.0, tree)], {1: 0.01})
    assert choice.best_chain() == 2  # plain and trees are no chains; the first among equals
    assert tree_choice.TreeChoice(None, "--tree off", [], {}).best_chain() is None
    assert torch.get_num_threads() >= 1
