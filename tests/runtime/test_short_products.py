"""The float32 products of short passes (viasd_core/runtime/short_products.py: blocked, packed)
against their plain reference (the layers themselves), the rule that decides where each runs, and
exactness with them."""

from types import SimpleNamespace

import pytest
import torch

from conftest import FAMILIES, tiny_model
from support.engine_cases import NEW, hf_greedy, make_engine, prompt_for
from viasd_core.runtime import short_products as sp
from viasd_core.machine import short_rows
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.runtime.layer_calls import mlp_call
from viasd_core.runtime.model import FastModel


def linear(x, layer, up_to=sp.BLOCKED):
    """An eager pass's product of `layer` for x's rows over `up_to` (bound as layer_calls binds it)."""
    return sp.eager_linear(x, layer, sp.as_short_rows(up_to), sp.takes_of(layer))


def mlp_over(module, up_to):
    """The MLP as an eager pass over the products `up_to` gives calls it (layer_calls.mlp_call)."""
    return mlp_call(module, SimpleNamespace(pass_rows=sp.as_short_rows(up_to)))


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
        got = linear(x, layer, up_to=16)
        assert got.shape == (1, rows, 96) and calls == [(sp.CHUNKS, 96 // sp.CHUNKS, 48)]  # it ran, in blocks
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(linear(x, layer, up_to=rows - 1), layer(x)) and len(calls) == 1  # over up_to: the layer


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_product_is_the_layers_product(rows, bias, monkeypatch):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 90, bias=bias)  # 90 outputs: no blocks of 4 needed
    x = torch.randn(1, rows, 48)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        got = linear(x, layer, sp.PACKED)
        assert got.shape == (1, rows, 90) and calls == [(rows, 48)]  # it ran, packed
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(linear(x, layer, sp.ShortRows(0, rows - 1)), layer(x)) and len(calls) == 1
        # the blocked product up to its rows, the packed one above them
        assert sp.ShortRows(1, 16).way(1) == "blocked" and sp.ShortRows(1, 16).way(rows) == ("packed" if rows > 1 else "blocked")


@needs_onednn
def test_the_packed_copy_follows_the_weight_and_stays_out_of_autograd():
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    with torch.no_grad():
        first = sp.packed_weight(layer)
        assert sp.packed_weight(layer) is first  # made once
        layer.weight.mul_(2)  # changed in place (an optimizer step): packed again
        assert sp.packed_weight(layer) is not first
        torch.testing.assert_close(linear(x, layer, sp.PACKED), layer(x), rtol=1e-5, atol=1e-5)
    y = linear(x, layer, sp.PACKED)  # with grad: the layer itself, so gradients flow
    y.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (8, 16)


def test_only_cpu_float32_linear_layers_take_it():
    assert sp.applies(torch.nn.Linear(8, 16))
    assert not sp.applies(torch.nn.Linear(8, 18))  # 18 rows do not split into 4 blocks
    assert not sp.applies(torch.nn.Linear(8, 16).to(torch.bfloat16))
    strided = torch.nn.Linear(16, 8)
    strided.weight = torch.nn.Parameter(torch.randn(16, 8).t())  # a transposed view: not split in place
    assert not sp.applies(strided)
    layer = torch.nn.Linear(8, 18)
    x = torch.randn(3, 8)
    assert torch.equal(linear(x, layer), layer(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mlp_over_it_is_the_familys_mlp(family):
    model = tiny_model(family, seed=3)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 6, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(mlp_over(mlp, 16)(x), mlp(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(mlp_over(mlp, 0)(x), mlp(x))


def test_a_pass_with_it_matches_the_pass_without():
    fast = FastModel(tiny_model("llama", seed=5), max_len=64)
    ids = torch.randint(3, 256, (40,))
    out = {}
    ways = (sp.PLAIN, sp.BLOCKED) + ((sp.PACKED, sp.ShortRows(1, 16)) if torch.backends.mkldnn.is_available() else ())
    for rows in ways:
        fast.short_rows = rows
        fast.reset()
        # a 34-token prompt (a long pass: packed with PACKED's prefill), then a decoded token and a block
        out[rows] = (fast.forward(ids[:34], 0, 1), fast.forward(ids[34:35], 34, 1), fast.forward(ids[35:40], 35, 5))
    for rows in ways[1:]:
        for a, b in zip(out[sp.PLAIN], out[rows]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rows", [0, 1, 16, sp.PACKED, sp.ShortRows(4, 16)], ids=str)
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
def timings(**ms):
    """{(way, width): seconds} from keyword lists of ms at widths 1, MID, WIDE: blocked=[..], packed=[..], plain=[..]."""
    return {(way, w): t / 1e3 for way, ts in ms.items() for w, t in zip(sp.TIMED, ts)}


def test_the_rule_follows_the_timings():
    # the AVX-512 EPYC with two threads: blocked at 1-4 rows, packed beyond
    rows, why = sp.pick_rows(timings(blocked=[11.0, 12.2, 22.8], packed=[12.2, 12.3, 13.1], plain=[25.5, 35.6, 28.3]))
    assert rows == sp.ShortRows(4, 16)
    assert why == ("1-token blocked 11.0, packed 12.2, plain 25.5 ms; 4-token blocked 12.2, packed 12.3, plain 35.6 ms; "
                   "6-token blocked 22.8, packed 13.1, plain 28.3 ms")
    # one thread: packed from 2 rows on
    assert sp.pick_rows(timings(blocked=[14.2, 22.2, 43.0], packed=[14.5, 15.5, 17.2], plain=[25, 37, 43]))[0] == sp.ShortRows(1, 16)
    assert sp.pick_rows(timings(blocked=[15, 16, 17], packed=[14, 15, 16], plain=[20, 20, 20]))[0] == sp.ShortRows(0, 16)
    # no oneDNN: the old rule (blocked everywhere, at 1 row only, or never)
    assert sp.pick_rows(timings(blocked=[23, 40, 59], plain=[53, 60, 73]))[0] == sp.BLOCKED
    assert sp.pick_rows(timings(blocked=[30, 80, 102], plain=[52, 70, 88]))[0] == sp.ShortRows(1, 0)
    assert sp.pick_rows(timings(blocked=[30, 60, 102], plain=[52, 70, 88]))[0] == sp.ShortRows(4, 0)
    rows, why = sp.pick_rows(timings(blocked=[60, 70, 102], plain=[52, 60, 88]))
    assert rows == sp.PLAIN and why.startswith("1-token blocked 60.0, plain 52.0 ms")
    assert all(tuple(r) in sp._VALID for r in (sp.PLAIN, sp.BLOCKED, sp.PACKED, sp.DEFAULT))
    assert sp.ShortRows(4, 16).describe() == "blocked up to 4 rows, packed up to 16"
    assert sp.ShortRows(1, 16, True).describe() == "blocked up to 1 row, packed up to 16, packed prefill"
    assert sp.PLAIN.describe() == "F.linear" and sp.PACKED.describe() == "packed up to 16, packed prefill"
    # a prefill chunk timed packed and plain: prefill takes the faster
    long = {("packed", 256): 0.20, ("plain", 256): 0.35}
    rows, why = sp.pick_rows({**timings(blocked=[11.0, 12.2, 22.8], packed=[12.2, 12.3, 13.1], plain=[25, 35, 28]), **long})
    assert rows == sp.ShortRows(4, 16, prefill=True) and why.endswith("; 256-token prefill chunk packed 200, plain 350 ms")
    slower = {("packed", 256): 0.40, ("plain", 256): 0.35}
    assert sp.pick_rows({**timings(blocked=[11, 12, 22], packed=[12, 12, 13], plain=[25, 35, 28]), **slower})[0] == sp.ShortRows(4, 16, False)
    assert [sp.ShortRows(1, 16, True).way(r) for r in (1, 2, 16, 17, 256)] == ["blocked"] + ["packed"] * 4
    assert [sp.ShortRows(1, 16).way(r) for r in (16, 17)] == ["packed", "plain"]


def test_a_session_measures_it_and_applies_it_to_every_model_and_the_head():
    target = tiny_model("llama", seed=5)
    engine = make_engine(target, draft_model=tiny_model("llama", n_layers=1, seed=6))
    rows, why = short_rows.choose_rows(engine, repeats=1)
    assert tuple(rows) in sp._VALID and {m.short_rows for m in engine.all_models()} == {rows}
    assert "1-token" in why and "4-token" in why and "6-token" in why and engine.target.seen == 0  # cache left empty
    assert ("packed" in why) == ("prefill chunk" in why) == torch.backends.mkldnn.is_available()
    low = make_engine(tiny_model("llama", seed=5).to(torch.bfloat16))
    assert short_rows.choose_rows(low) == (sp.PLAIN, "no float32 layers on a CPU") and low.target.short_rows == sp.PLAIN


@pytest.mark.parametrize("rows", [sp.PLAIN, sp.BLOCKED, sp.ShortRows(1, 16)], ids=str)
def test_the_eagle_head_takes_it_too_and_sd_stays_ar(rows):
    from support.head_cases import engine_with_head, make_head

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
    from viasd_core.runtime import pass_timing

    engine = make_engine(tiny_model("llama", seed=5))
    timed = []
    real = pass_timing.time_passes
    monkeypatch.setattr(pass_timing, "time_passes", lambda *a, **k: timed.append(1) or real(*a, **k))
    key = {"target": "tiny", "draft": "none", "format": "none", "dtype": "float32"}
    per = 2 * (3 + 2) if torch.backends.mkldnn.is_available() else 2 * 2  # 2 rounds x (each way + the prefill chunk twice)
    rows, why = short_rows.choose_rows(engine, key, repeats=1)
    assert len(timed) == per and not why.endswith("(cached)")
    engine.set_short_rows(sp.ShortRows(5, 0))
    again, why_again = short_rows.choose_rows(engine, key, repeats=1)
    assert (again, why_again) == (rows, why + " (cached)") and len(timed) == per and engine.target.short_rows == rows
    short_rows.choose_rows(engine, key, refresh=True, repeats=1)
    assert len(timed) == 2 * per
    short_rows.choose_rows(engine, {**key, "target": "other"}, repeats=1)  # other models: their own choice
    assert len(timed) == 3 * per
    path = next((viasd_home / "cache" / "machine").glob("short-rows-*.json"))
    for bad in ("{not json", '{"blocked": 3, "packed": 0, "prefill": false, "reason": "x"}',
                '{"blocked": 1, "packed": 16, "prefill": 1, "reason": "x"}', '{"rows": 16, "reason": "version 1"}'):
        # unreadable, a value no rule gives, or an older record's fields: measured again
        for f in (viasd_home / "cache" / "machine").glob("short-rows-*.json"):
            f.write_text(bad)
        before = len(timed)
        short_rows.choose_rows(engine, key, repeats=1)
        assert len(timed) == before + per
    assert path.exists()



def test_the_packed_copies_are_left_out_where_they_would_crowd_the_memory(viasd_home, monkeypatch):
    from viasd_core import devices

    engine = make_engine(tiny_model("llama", seed=5))
    need = sp.packed_bytes(engine.all_models())
    layers = [m for m in engine.target.hf_model.modules() if isinstance(m, torch.nn.Linear)]
    assert need == sum(m.weight.numel() * 4 for m in layers) > 0  # every float32 layer once
    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: int(need / sp.FREE_SHARE) - 1)
    key = {"target": "tiny", "draft": "none", "format": "none", "dtype": "float32"}
    rows, why = short_rows.choose_rows(engine, key, repeats=1)
    assert rows.packed == 0 and "packed" not in why.split("; packed not taken")[0] and why.endswith("GiB)")  # not timed
    assert "packed not taken" in why
    # a cached choice with packed products, on a machine whose memory has filled since: packed dropped
    path = next((viasd_home / "cache" / "machine").glob("short-rows-*.json"))
    path.write_text('{"blocked": 1, "packed": 16, "prefill": true, "reason": "measured"}')
    rows, why = short_rows.choose_rows(engine, key, repeats=1)
    assert rows == sp.ShortRows(1, 0) and why.startswith("measured (cached); packed not taken")
    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: int(need / sp.FREE_SHARE) + 1)
    assert short_rows.choose_rows(engine, key, repeats=1)[0] == sp.ShortRows(1, 16, True)  # room again: the cached choice as it was


@needs_onednn
def test_prefill_chunks_take_the_packed_product_only_when_chosen(monkeypatch):
    fast = FastModel(tiny_model("llama", seed=5), max_len=64)
    ids = torch.randint(3, 256, (34,))
    rows_seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: rows_seen.append(a[0].shape[0]) or real(*a))
    for prefill in (False, True):
        rows_seen.clear()
        fast.short_rows = sp.ShortRows(1, 16, prefill)
        fast.reset()
        fast.forward(ids, 0, 1)
        # every projection of every layer over the 34 positions, and the output head over the last one (1 row: blocked)
        assert rows_seen == ([34] * 7 * len(fast.layers) if prefill else [])
