"""CUDA graph trees may overwrite a compiled call's outputs at the next compiled call; the stand-in
(viasd_core/runtime/graph_outputs.py) poisons them there on any device, so a CPU run shows a stale
read. Here: what it poisons and spares, how it is switched on, and that compiled greedy ar, sd and
exact read no stale output (they still equal eager ar with the check on).

Compiled on this CPU through inductor, as in tests/speculation/test_compiled_step.py: tiny models, short runs.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyTokenizer, tiny_model
from viasd_core.runtime import graph_outputs
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel

INT_MIN = torch.iinfo(torch.int64).min


def test_the_next_call_poisons_every_earlier_output_and_spares_clones_and_static_tensors():
    buffer = torch.arange(6.0)  # a static input (a model buffer): not pool memory on CUDA
    first = graph_outputs.guard(lambda x: (x * 2, x.argmax(-1, keepdim=True), x > 0, buffer[:3]), static=[buffer])
    other = graph_outputs.guard(lambda x: x + 1)  # another compiled function: graph trees share one pool
    x = torch.tensor([0.5, -1.0, 2.0, -3.0])
    with graph_outputs.checking():
        before = graph_outputs.poisoned
        doubled, argmax, positive, static_view = first(x)
        kept = doubled.clone()  # copied before the next call: survives
        tail = doubled[1:]  # a view: it reads the same memory
        plus = other(x)
        assert torch.isnan(doubled).all() and torch.isnan(tail).all()
        assert argmax.tolist() == [INT_MIN]
        assert positive.tolist() == [False, True, False, True]  # booleans are negated
        assert torch.equal(static_view, buffer[:3]) and torch.equal(buffer, torch.arange(6.0))  # spared
        assert torch.equal(kept, x * 2)
        assert torch.equal(plus, x + 1)  # the latest call's output is intact until the next call
        again = first(x)
        assert torch.isnan(plus).all() and torch.equal(again[0], x * 2)
        assert graph_outputs.poisoned - before == 4  # 3 outputs of the first call, then `plus`
        with torch.inference_mode():  # as in FastModel.forward: a view of an output does not keep its base
            row = other(x)[1:]
        other(x)
        assert torch.isnan(row).all()  # the output's memory is poisoned, whoever still reads it


def test_the_environment_or_a_test_switches_it_on(monkeypatch):
    double = graph_outputs.guard(lambda x: x * 2)
    x = torch.ones(3)

    def stale_after_next_call() -> bool:
        out = double(x)
        double(x)
        return bool(torch.isnan(out).all())

    monkeypatch.delenv(graph_outputs.ENV, raising=False)
    assert not graph_outputs.active() and not stale_after_next_call()
    monkeypatch.setenv(graph_outputs.ENV, "1")
    assert graph_outputs.active() and stale_after_next_call()
    with graph_outputs.checking(False):  # a test may turn it off whatever the environment says
        assert not stale_after_next_call()
    monkeypatch.setenv(graph_outputs.ENV, "0")
    with graph_outputs.checking():
        assert stale_after_next_call()
    assert not stale_after_next_call()


# ---------------------------------------------------------------------- compiled models
TARGET_SEED = 5
PROMPT = [5, 17, 33, 11, 64, 80]
NEW = 24


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", n_layers=4, seed=TARGET_SEED)


@pytest.fixture(scope="module")
def compiled_engine(target):
    """Target, a layer-skipping draft of it (agrees often, not always) and a slim, compiled (not warmed
    up: only the graphs the runs meet compile). The target also captures features, as under a head."""
    eng = Engine(FastModel(target, max_len=128), TinyTokenizer(),
                 drafter=ModelDrafter(FastModel(target, layer_ids=[0, 1, 3], max_len=128, name="draft"), 256),
                 slim=FastModel(target, layer_ids=[0, 2], max_len=128, name="slim"))
    eng.target.capture_features((1, 2, 3))
    assert eng.compile()
    return eng


def test_a_compiled_pass_poisons_the_previous_logits_but_never_the_caches(target, compiled_engine):
    fast = compiled_engine.target
    eager = FastModel(target, max_len=128)
    eager.capture_features((1, 2, 3))
    ids = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(6))
    want = [eager.forward(ids[:10], 0, 1), eager.forward(ids[10:11], 10, 1), eager.forward(ids[11:13], 11, 2),
            eager.forward(ids[13:14], 13, 1)]
    with graph_outputs.checking():
        fast.reset()
        fast.forward(ids[:10], 0, 1)  # a prefill: eager, not a graph
        first = fast.forward(ids[10:11], 10, 1)  # compiled (width 1)
        kept = first.clone()
        second = fast.forward(ids[11:13], 11, 2)  # compiled (width 2, every row: a view of the output)
        assert torch.isnan(first).all()
        torch.testing.assert_close(kept, want[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(second, want[2], rtol=1e-4, atol=1e-4)
        third = fast.forward(ids[13:14], 13, 1)
        assert torch.isnan(second).all()
        torch.testing.assert_close(third, want[3], rtol=1e-4, atol=1e-4)
        # The KV caches and the captured features are written inside the graph: inputs, never poisoned.
        torch.testing.assert_close(fast.cache.features[:14], eager.cache.features[:14], rtol=1e-4, atol=2e-4)
        for mine, theirs in zip(fast.cache.layers, eager.cache.layers):
            torch.testing.assert_close(mine.k[:, :, :14], theirs.k[:, :, :14], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.v[:, :, :14], theirs.v[:, :, :14], rtol=1e-4, atol=1e-4)
    fast.reset()


@pytest.mark.parametrize("mode", ["ar", "sd", "exact"])
def test_compiled_greedy_generation_reads_no_stale_output(target, compiled_engine, mode):
    """With every compiled call poisoning the earlier calls' outputs, compiled greedy generation still
    emits eager ar's tokens: no step reads a compiled pass's output after the next compiled pass."""
    want = Engine(FastModel(target, max_len=128), TinyTokenizer()).generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=NEW))
    with graph_outputs.checking():
        before = graph_outputs.checked
        compiled_engine.reset()
        got = compiled_engine.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=3, adaptive=False))
        checked = graph_outputs.checked - before
    assert got.tokens == want.tokens
    assert checked >= got.stats.target_passes  # every target pass after the prefill ran compiled, checked
    if mode != "ar":
        assert got.stats.draft_tokens > 0 and 0 < got.stats.acceptance_rate < 1  # blocks, some rejected


@pytest.mark.parametrize("mode", ["sd", "viasd"])
def test_calibration_recording_reads_no_stale_output(target, compiled_engine, mode):
    """Calibration's recorder (an engine observer) runs the passes a step did not run, after the step:
    under the stand-in the compiled run still emits eager ar's tokens and records the same blocks as
    an eager engine. (Recording inside the step read the target's logits after the slim's compiled
    pass: every token came out 0 under the stand-in.)"""
    from viasd_core.calibration.recording import BlockRecorder
    from viasd_core.speculation.router import Thresholds

    config = GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=3, adaptive=False,
                              thresholds=Thresholds(accept=1.0, slim=0.5) if mode == "viasd" else None)
    eager = Engine(FastModel(target, max_len=128), TinyTokenizer(),
                   drafter=ModelDrafter(FastModel(target, layer_ids=[0, 1, 3], max_len=128, name="draft"), 256),
                   slim=FastModel(target, layer_ids=[0, 2], max_len=128, name="slim"))
    want_rec = BlockRecorder()
    eager.observers.append(want_rec)
    want = eager.generate(PROMPT, config)
    got_rec = BlockRecorder()
    compiled_engine.observers.append(got_rec)
    try:
        with graph_outputs.checking():
            compiled_engine.reset()
            got = compiled_engine.generate(PROMPT, config)
    finally:
        compiled_engine.observers.remove(got_rec)
    assert got.tokens == want.tokens
    if mode == "sd":
        ar = Engine(FastModel(target, max_len=128), TinyTokenizer()).generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=NEW))
        assert got.tokens == ar.tokens
    assert len(got_rec.blocks) == len(want_rec.blocks) > 0
    for mine, theirs in zip(got_rec.blocks, want_rec.blocks):
        assert (mine.draft_ok, mine.slim_ok, mine.draft_eq_slim, mine.slim_bonus_ok) == \
            (theirs.draft_ok, theirs.slim_ok, theirs.draft_eq_slim, theirs.slim_bonus_ok)
        assert mine.gate == pytest.approx(theirs.gate, abs=1e-4)
        assert mine.confidence == pytest.approx(theirs.confidence, abs=1e-4)
