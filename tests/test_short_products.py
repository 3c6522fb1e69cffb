"""The blocked float32 product of short passes (viasd_core/decoding/short_products.py) against its
plain reference (the layers themselves), the rule that decides where it runs, and exactness with it."""

import pytest
import torch

from conftest import FAMILIES, tiny_model
from test_engine_greedy import NEW, hf_greedy, make_engine, prompt_for
from viasd_core.decoding import short_products as sp
from viasd_core.decoding.engine import GenerationConfig
from viasd_core.decoding.model import FastModel


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_blocked_product_is_the_layers_product(rows, bias, monkeypatch):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 96, bias=bias)
    x = torch.randn(1, rows, 48)
    calls = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        got = sp.linear(x, layer, up_to=16)
        assert got.shape == (1, rows, 96) and calls == [(sp.CHUNKS, 96 // sp.CHUNKS, 48)]  # it ran, in blocks
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(sp.linear(x, layer, up_to=rows - 1), layer(x)) and len(calls) == 1  # over up_to: the layer


def test_only_cpu_float32_linear_layers_take_it():
    assert sp.applies(torch.nn.Linear(8, 16))
    assert not sp.applies(torch.nn.Linear(8, 18))  # 18 rows do not split into 4 blocks
    assert not sp.applies(torch.nn.Linear(8, 16).to(torch.bfloat16))
    strided = torch.nn.Linear(16, 8)
    strided.weight = torch.nn.Parameter(torch.randn(16, 8).t())  # a transposed view: not split in place
    assert not sp.applies(strided)
    layer = torch.nn.Linear(8, 18)
    x = torch.randn(3, 8)
    assert torch.equal(sp.linear(x, layer), layer(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mlp_over_it_is_the_familys_mlp(family):
    model = tiny_model(family, seed=3)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 6, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(sp.mlp(x, mlp, up_to=16), mlp(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(sp.mlp(x, mlp, up_to=0), mlp(x))


def test_a_pass_with_it_matches_the_pass_without():
    fast = FastModel(tiny_model("llama", seed=5), max_len=64)
    ids = torch.randint(3, 256, (20,))
    out = {}
    for rows in (0, 16):
        fast.short_rows = rows
        fast.reset()
        fast.forward(ids[:14], 0, 1)
        out[rows] = (fast.forward(ids[14:15], 14, 1), fast.forward(ids[15:20], 15, 5))
    for a, b in zip(out[0], out[16]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rows", [0, 1, 16])
def test_sd_equals_ar_and_transformers_whichever_passes_take_it(family, rows):
    target = tiny_model(family, seed=11)
    draft = tiny_model(family, n_layers=1, seed=99)
    for seed in range(2):
        prompt = prompt_for(seed)
        reference = hf_greedy(target, prompt, NEW)
        for mode, gamma in (("ar", 1), ("sd", 3), ("sd", 6)):
            engine = make_engine(target, draft_model=None if mode == "ar" else draft)
            for model in engine.all_models():
                model.short_rows = rows
            out = engine.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=gamma, adaptive=False))
            assert out.tokens == reference, (family, rows, mode, gamma)


# ---------------------------------------------------------------------- where it runs
def timings(blocked_1, plain_1, blocked_6, plain_6):
    return {("blocked", 1): blocked_1, ("plain", 1): plain_1, ("blocked", 6): blocked_6, ("plain", 6): plain_6}


def test_the_rule_follows_the_timings():
    rows, why = sp.pick_rows(timings(0.023, 0.053, 0.059, 0.073))  # two threads here: faster at both
    assert rows == 16
    assert why == "1-token 23.0 vs 53.0 ms, 6-token 59.0 vs 73.0 ms, blocked vs F.linear"
    assert sp.pick_rows(timings(0.030, 0.052, 0.102, 0.088))[0] == 1  # one thread here: a wide pass loses
    rows, why = sp.pick_rows(timings(0.060, 0.052, 0.102, 0.088))
    assert rows == 0 and why.startswith("1-token 60.0 vs 52.0 ms")


def test_a_session_measures_it_and_applies_it_to_every_model_and_the_head():
    target = tiny_model("llama", seed=5)
    engine = make_engine(target, draft_model=tiny_model("llama", n_layers=1, seed=6))
    rows, why = sp.choose_rows(engine, repeats=1)
    assert rows in (0, 1, 16) and {m.short_rows for m in engine.all_models()} == {rows}
    assert "1-token" in why and "6-token" in why and engine.target.seen == 0  # the cache is left empty
    low = make_engine(tiny_model("llama", seed=5).to(torch.bfloat16))
    assert sp.choose_rows(low) == (0, "no float32 layers on a CPU") and low.target.short_rows == 0


@pytest.mark.parametrize("rows", [0, 16])
def test_the_eagle_head_takes_it_too_and_sd_stays_ar(rows):
    from test_feature_drafter import engine_with_head, make_head

    target = tiny_model("llama", n_layers=5, seed=5)
    head = make_head(target, seed=5)
    engine = engine_with_head(target, head, hybrid=True)
    engine.set_short_rows(rows)
    assert head.short_rows == rows and {m.short_rows for m in engine.all_models()} == {rows}
    for seed in range(2):
        prompt = prompt_for(seed)
        ar = engine.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        sd = engine.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4, adaptive=False))
        assert sd.tokens == ar and sd.stats.draft_tokens > 0


def test_the_choice_is_cached_per_machine_and_measured_again_on_refresh(viasd_home, monkeypatch):
    from viasd_core.decoding import pass_timing

    engine = make_engine(tiny_model("llama", seed=5))
    timed = []
    real = pass_timing.time_passes
    monkeypatch.setattr(pass_timing, "time_passes", lambda *a, **k: timed.append(1) or real(*a, **k))
    key = {"target": "tiny", "draft": "none", "format": "none", "dtype": "float32"}
    rows, why = sp.choose_rows(engine, key, repeats=1)
    assert len(timed) == 4 and not why.endswith("(cached)")  # 2 rounds x 2 ways
    engine.set_short_rows(5)
    again, why_again = sp.choose_rows(engine, key, repeats=1)
    assert (again, why_again) == (rows, why + " (cached)") and len(timed) == 4 and engine.target.short_rows == rows
    sp.choose_rows(engine, key, refresh=True, repeats=1)
    assert len(timed) == 8
    sp.choose_rows(engine, {**key, "target": "other"}, repeats=1)  # other models: their own choice
    assert len(timed) == 12
    path = next((viasd_home / "cache" / "machine").glob("short-rows-*.json"))
    for bad in ("{not json", '{"rows": 3, "reason": "x"}'):  # unreadable, or a value no rule gives: measured again
        for f in (viasd_home / "cache" / "machine").glob("short-rows-*.json"):
            f.write_text(bad)
        before = len(timed)
        sp.choose_rows(engine, key, repeats=1)
        assert len(timed) == before + 4
    assert path.exists()

