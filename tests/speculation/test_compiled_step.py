"""The compiled, sync-free step: compiled == eager, no recompilation mid-generation, host reads
counted (not claimed), the context allocated once with clear errors.

torch.compile runs through inductor on this CPU exactly as it would on a GPU (without CUDA graphs);
the eager path is the same pass function uncompiled, the plain reference.
"""

import pytest
import torch

from conftest import FAMILIES, TinyTokenizer, tiny_model
from support.engine_cases import graphs_compiled
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.errors import UsageError, ViasdError
from viasd_core.runtime.model import PASS_WIDTHS, FastModel


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_passes_match_eager_logits(family):
    model = tiny_model(family, seed=3)
    eager = FastModel(model, max_len=96)
    compiled = FastModel(model, max_len=96)
    assert compiled.compile(None)
    ids = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(4))
    before = graphs_compiled()
    # prefill (eager in both), 1-token steps, a 2-token catch-up, verify blocks padded to 4 and 8
    plan = [(0, 20, 1), (20, 1, 1), (21, 1, 1), (22, 2, 1), (24, 3, 3), (27, 5, 5), (32, 1, 1)]
    for start, length, n_logits in plan:
        want = eager.forward(ids[start : start + length], start, n_logits)
        got = compiled.forward(ids[start : start + length], start, n_logits)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphs_compiled() - before == 4  # (1,1), (2,1), (4,4), (8,8): the compiled path really ran
    assert compiled.seen == eager.seen == 33


def test_a_compiled_pass_over_packed_short_products_traces_the_plain_one():
    """A session chooses the short products before it compiles (session.py): a compiled model whose
    `short_rows` gives packed products compiles F.linear instead (the packed copy is eager-only)."""
    from viasd_core.runtime.short_products import ShortRows

    model = tiny_model("llama", seed=3)
    eager, compiled = FastModel(model, max_len=96), FastModel(model, max_len=96)
    for m in (eager, compiled):
        m.short_rows = ShortRows(1, 16, prefill=True)
    assert compiled.compile(None)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(4))
    for start, length, n_logits in [(0, 20, 1), (20, 1, 1), (21, 5, 5), (26, 3, 3)]:
        want = eager.forward(ids[start : start + length], start, n_logits)
        got = compiled.forward(ids[start : start + length], start, n_logits)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_dynamic_row_count_compiles_fewer_graphs_with_the_same_logits():
    """compile(dynamic=True) (benchmarks/experiments/frozen_compile.py): one graph serves every width above 1."""
    model = tiny_model("llama", seed=3)
    eager = FastModel(model, max_len=96)
    compiled = FastModel(model, max_len=96)
    assert compiled.compile(None, dynamic=True)
    ids = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(4))
    before = graphs_compiled()
    plan = [(0, 20, 1), (20, 1, 1), (21, 1, 1), (22, 2, 1), (24, 3, 3), (27, 5, 5), (32, 1, 1), (33, 9, 9)]
    for start, length, n_logits in plan:
        torch.testing.assert_close(compiled.forward(ids[start : start + length], start, n_logits),
                                   eager.forward(ids[start : start + length], start, n_logits), rtol=1e-4, atol=1e-4)
    # 1 token; 2 tokens with 1 logit row; 4, 8 and 16 tokens with all rows share one graph
    # (static shapes would compile five: (1,1), (2,1), (4,4), (8,8), (16,16))
    assert graphs_compiled() - before == 3


def engine_pair(seed=5, compiled=False, slim_layers=(0, 2)):
    """A tiny target, a layer-skipping draft of it (agrees often, not always: gamma moves) and a slim."""
    target = tiny_model("llama", n_layers=4, seed=seed)
    eng = Engine(FastModel(target, max_len=256), TinyTokenizer(),
                 drafter=ModelDrafter(FastModel(target, layer_ids=[0, 1, 3], max_len=256, name="draft"), 256),
                 slim=FastModel(target, layer_ids=list(slim_layers), max_len=256, name="slim"))
    if compiled:
        assert eng.compile()
        assert eng.warm_up() > 0
    return eng


@pytest.fixture(scope="module")
def compiled_engine():
    return engine_pair(compiled=True)


@pytest.mark.parametrize("mode,temperature", [("ar", 0.0), ("sd", 0.0), ("exact", 0.0), ("sd", 0.8), ("exact", 0.8)])
def test_compiled_engine_emits_the_eager_tokens(compiled_engine, mode, temperature):
    eager = engine_pair(compiled=False)
    # --fixed: the draft-length policy follows wall time, which differs between the two engines
    config = dict(mode=mode, max_new_tokens=40, gamma=3, temperature=temperature, seed=11, adaptive=False)
    prompt = [5, 17, 33, 2 + 9, 64, 80]
    for eng in (eager, compiled_engine):
        eng.reset()
    want = eager.generate(prompt, GenerationConfig(**config))
    got = compiled_engine.generate(prompt, GenerationConfig(**config))
    assert got.tokens == want.tokens
    assert got.stats.target_passes == want.stats.target_passes
    if mode != "ar" and temperature == 0.0:  # greedy: and equal to plain decoding
        compiled_engine.reset()
        ar = compiled_engine.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=40))
        assert got.tokens == ar.tokens


def test_no_recompilation_during_generation(compiled_engine):
    """After the warm-up, nothing compiles: 50+ adaptive steps (plain steps and blocks of varying
    length), then every verify width (gamma 1, 3, 7, 12: widths 2, 4, 8, 16) and exact mode."""
    compiled_engine.reset()
    before = graphs_compiled()
    gen = compiled_engine.generate(list(range(3, 30)), GenerationConfig(mode="sd", max_new_tokens=250, gamma=2,
                                                                        gamma_max=12, adaptive=True))
    assert gen.stats.steps >= 50
    widths = set()
    for gamma in (1, 3, 7, 12):
        compiled_engine.reset()
        gen = compiled_engine.generate(list(range(3, 30)), GenerationConfig(mode="sd", max_new_tokens=40, gamma=gamma,
                                                                            adaptive=False))
        widths.add(len(gen.stats.position_attempts) + 1)
    assert widths == {2, 4, 8, 13}  # blocks of 1, 3, 7 and 12 drafted tokens ran (12 + 1 pads to 16)
    compiled_engine.reset()
    compiled_engine.generate([7] * 20, GenerationConfig(mode="exact", max_new_tokens=60, gamma=6))
    assert graphs_compiled() == before


def test_every_pass_of_up_to_16_tokens_runs_compiled(compiled_engine):
    """Catch-ups with one logit row padded to 4, 8 and 16 run their warmed-up graphs like 1-token
    steps (issue 22 item 7: they ran eagerly): viasd accepting every drafted token leaves the
    target behind, and its plain step catches up over the whole stretch. Only a pass over 16
    tokens (the prompt's prefill) runs eagerly. The eager `_run` calls are counted per model."""
    from viasd_core.speculation.router import Thresholds

    eng = compiled_engine
    eager: list[tuple[str, int]] = []  # (model, tokens) of every eager pass
    passes: list[tuple[str, int, int]] = []  # (model, tokens, logit rows) of every pass
    for fm in eng.all_models():
        run, forward = fm._run, fm.forward  # the compiled graph holds the original `_run`

        def counted_run(input_ids, *args, _run=run, _name=fm.name):
            eager.append((_name, input_ids.shape[0]))
            return _run(input_ids, *args)

        def recorded(input_ids, start, n_logits=1, _forward=forward, _name=fm.name):
            passes.append((_name, input_ids.shape[0], n_logits))
            return _forward(input_ids, start, n_logits)

        fm._run, fm.forward = counted_run, recorded
    before = graphs_compiled()
    prompt = list(range(3, 24))  # 21 tokens: a prefill over 16
    try:
        # Blocks emit gamma + 1 tokens; once one token is left a plain step runs the target over all
        # of them and the last prompt token: over 4, 8, 16, then 21 tokens.
        for gamma, new in ((2, 4), (6, 8), (4, 16), (9, 21)):
            eng.reset()
            eng.generate(prompt, GenerationConfig(mode="viasd", max_new_tokens=new, gamma=gamma, adaptive=False,
                                                  thresholds=Thresholds(accept=0.0, slim=0.0)))
        eng.reset()
        eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=30, gamma=3))
    finally:
        for fm in eng.all_models():
            del fm._run, fm.forward
    catch_ups = {T for name, T, rows in passes if name == "target" and rows == 1 and T > 2}
    assert {4, 8, 16, 21} <= catch_ups, sorted(catch_ups)
    assert eager and all(T > PASS_WIDTHS[-1] for _, T in eager), eager  # prefills and the 21-token catch-up
    assert ("target", 21) in eager
    assert graphs_compiled() == before  # the warm-up compiled every shape met


class HostReads:
    """Counts every device-to-host read a tensor can make (tolist, item, int(), float(), bool(), cpu, numpy)."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode,temperature", [("sd", 0.0), ("sd", 1.0), ("exact", 0.0), ("ar", 0.0)])
def test_one_host_read_per_step(monkeypatch, compiled_engine, compiled, mode, temperature):
    eng = compiled_engine if compiled else engine_pair()
    eng.reset()
    prompt = list(range(3, 40))
    config = GenerationConfig(mode=mode, max_new_tokens=30, gamma=4, temperature=temperature, seed=1, min_confidence=0.0)
    eng.generate(prompt, config)  # warm: first calls may read for set-up
    eng.reset()
    eng.host_reads = 0
    reads = HostReads(monkeypatch)
    gen = eng.generate(prompt, config)
    monkeypatch.undo()
    assert gen.stats.steps >= 8
    assert eng.host_reads == gen.stats.steps  # the engine's own count: one read a step
    assert reads.count == gen.stats.steps  # and nothing else read the device


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_confidence_stop_rule_reads_once_per_drafted_position_and_says_so(monkeypatch, temperature):
    """With the stop rule on, the draft reads its confidence at each position it drafts: the engine
    counts those reads too, and nothing else reads."""
    eng = engine_pair()
    prompt = list(range(3, 40))
    config = GenerationConfig(mode="sd", max_new_tokens=30, gamma=4, temperature=temperature, seed=1, min_confidence=0.01)
    eng.generate(prompt, config)
    eng.reset()
    eng.host_reads = 0
    reads = HostReads(monkeypatch)
    gen = eng.generate(prompt, config)
    monkeypatch.undo()
    assert gen.stats.draft_tokens > 0
    assert eng.host_reads == reads.count
    assert gen.stats.steps + gen.stats.draft_tokens <= reads.count <= gen.stats.steps + gen.stats.draft_tokens + gen.stats.steps


def test_caches_are_allocated_once_and_the_context_is_a_clear_limit():
    model = tiny_model("llama", seed=2)
    eng = Engine(FastModel(model, max_len=64), TinyTokenizer(), context_len=64)
    k_buffer = eng.target.cache.layers[0].k
    assert k_buffer.shape[2] == 64 + PASS_WIDTHS[-1]  # slack for a padded pass at the end
    gen = eng.generate(list(range(3, 40)), GenerationConfig(mode="ar", max_new_tokens=100))
    assert len(gen.tokens) == 64 - 37 and gen.finish_reason == "length"  # stops at the context
    assert eng.target.cache.layers[0].k is k_buffer  # never re-allocated
    eng.reset()
    with pytest.raises(ViasdError, match="--max-context"):
        eng.generate(list(range(3, 70)), GenerationConfig(mode="ar", max_new_tokens=4))
    with pytest.raises(ViasdError, match="--max-context"):
        eng.target.forward(torch.zeros(70, dtype=torch.long), 0)


def test_max_context_option_is_checked(tiny_dirs, viasd_home):
    from viasd_core.session import build_session
    from viasd_core.loading.options import ModelOptions

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), max_context=100), mode="ar")
    assert session.engine.context_len == 100 and session.engine.target.max_len == 100
    with pytest.raises(UsageError, match="exceeds the model's context"):
        build_session(ModelOptions(model=str(tiny_dirs["target"]), max_context=10_000), mode="ar")
    with pytest.raises(UsageError, match="at least 16"):
        build_session(ModelOptions(model=str(tiny_dirs["target"]), max_context=4), mode="ar")
    with pytest.raises(UsageError, match="--compile"):
        build_session(ModelOptions(model=str(tiny_dirs["target"]), compile="sometimes"), mode="ar")


def test_gamma_beyond_the_widest_pass_is_refused():
    with pytest.raises(UsageError, match="gamma can be at most"):
        GenerationConfig(mode="sd", gamma=16, adaptive=False).validate()
    with pytest.raises(UsageError, match="gamma can be at most"):
        GenerationConfig(mode="sd", gamma=4, gamma_max=20).validate()
