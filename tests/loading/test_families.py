"""The families issue 50 added (conftest.NEW_FAMILIES: Gemma 2, Gemma 3 text, Phi-3/4, Qwen3-MoE, Mixtral), each
exact on a tiny random float32 model: FastModel's pass computes transformers' logits, greedy `ar`
emits transformers' generate() tokens, `sd` emits `ar`'s, and every row of a short pass comes out
bit for bit as the row alone (the property sd == ar rests on). Their tiny configs (conftest.tiny_config)
set what sets each family apart: Gemma 2's attention and final soft-caps, query_pre_attn_scalar and
four norms a layer, sliding layers alternating with global ones; Gemma 3's q/k norms and the sliding
layers' own RoPE base; Phi-4-mini's partial rotary over fused q/k/v and gate/up; a Qwen3-MoE block
(4 experts, 2 a token) next to a dense layer; Mixtral's MoE blocks (4 experts, 2 a token) in every layer,
without a sliding window as Mixtral-8x7B (and with one: `test_mixtral_with_a_sliding_window`).
"""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_FAMILIES, multimodal_config, tiny_config, tiny_model
from support.engine_cases import graphs_compiled, hf_greedy, make_engine, prompt_for
from support.invariance_cases import PROMPT, SPAN, target, tokens, width_dependent_rows
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.errors import ViasdError

NEW = 24


def passes_of_every_kind(fast: FastModel, ids: torch.Tensor) -> torch.Tensor:
    """A prefill of 12, four 1-token passes, a block of 4, a rollback and a block of 8 (past the
    sliding window of 8): every position's logits."""
    out = [fast.forward(ids[:12], 0, 12)]
    out += [fast.forward(ids[i : i + 1], i, 1) for i in range(12, 16)]
    out.append(fast.forward(ids[16:20], 16, 4))
    fast.rollback(18)
    out.append(fast.forward(ids[18:26], 18, 8))
    return torch.cat(out[:-2] + [out[-2][:2], out[-1]])


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_fast_pass_computes_transformers_logits(family):
    model = tiny_model(family, seed=1)
    fast = FastModel(model, max_len=64)
    ids = torch.randint(3, 256, (26,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids[None]).logits[0].float()
    torch.testing.assert_close(passes_of_every_kind(fast, ids), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_prefill_in_chunks_computes_transformers_logits(family, monkeypatch):
    """A pass longer than PREFILL_CHUNK runs layer by layer over chunks: each layer's own RoPE table
    and window (8, as the chunks here) over chunk borders."""
    from viasd_core.runtime import model_pass as model_module

    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 8)
    model = tiny_model(family, seed=4)
    ids = torch.randint(3, 256, (26,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    got = FastModel(model, max_len=64).forward(ids, 0, 26)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_sd_equals_ar_equals_transformers(family):
    target_model = tiny_model(family, seed=11)
    draft = tiny_model(family, n_layers=1, seed=99)
    for seed in range(2):
        prompt = prompt_for(seed)
        reference = hf_greedy(target_model, prompt, NEW)
        ar = make_engine(target_model).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        assert ar.tokens == reference, (family, seed)
        for draft_model, gamma in ((target_model, 3), (draft, 1), (draft, 5)):
            sd = make_engine(target_model, draft_model=draft_model).generate(
                prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma, adaptive=False))
            assert sd.tokens == reference, (family, seed, gamma)
            assert sd.stats.draft_tokens > 0
            if draft_model is target_model:
                assert sd.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_exact_with_a_slim_view_equals_ar(family):
    """`exact` mode's slim view runs a subset of the layers (its own RoPE tables' indices, windows,
    caps and MoE blocks by layer): its tokens are still ar's."""
    target_model = tiny_model(family, n_layers=6, seed=14)
    prompt = prompt_for(20)
    reference = hf_greedy(target_model, prompt, NEW)
    for draft_model in (target_model, tiny_model(family, n_layers=1, seed=98)):
        eng = make_engine(target_model, draft_model=draft_model, slim_layers=[0, 2, 3, 5])
        out = eng.generate(prompt, GenerationConfig(mode="exact", max_new_tokens=NEW, gamma=4))
        assert out.tokens == reference and out.stats.slim_passes > 0


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_rows_logits_do_not_depend_on_its_pass(family, fmt):
    """As tests/machine/test_row_invariance.py for the older families, at 2 threads: Gemma 2's capped
    attention (each row through operators alone), Gemma 3's two RoPE tables, Phi-3's partial rotary,
    Qwen3-MoE's experts (each row routed alone)."""
    torch.set_num_threads(2)
    fast = target(family, fmt)
    assert fast.row_attention
    assert width_dependent_rows(fast, tokens(PROMPT + SPAN + 8, seed=2)) == {}


def test_gemma2_caps_and_gemma3_local_rope_are_what_the_pass_reads():
    """What the tiny configs exercise is what FastModel applies: Gemma 2's caps, Gemma 3's second
    RoPE table for its sliding layers, both families' sliding windows on alternate layers."""
    g2 = FastModel(tiny_model("gemma2", seed=1), max_len=32)
    assert [c.softcap for c in g2._calls] == [5.0] * 4 and g2.final_softcap == 12.0
    assert g2.windows == [8, None, 8, None] and g2.cache.tables == 1
    g3 = FastModel(tiny_model("gemma3_text", seed=1), max_len=32)
    assert [c.softcap for c in g3._calls] == [None] * 4 and g3.final_softcap is None
    assert g3.windows == [8, None, 8, None] and g3.cache.tables == 2 and g3._rope_ix == [1, 0, 1, 0]
    assert not torch.equal(g3.cache.cos[:20], g3.cache.cos_1[:20])  # bases 1e6 (global) and 1e4 (local)
    phi = FastModel(tiny_model("phi3", seed=1), max_len=32)
    assert phi.cache.cos.shape[-1] == 12 and phi._calls[0].q is None and phi._calls[0].qkv_split == (64, 32, 32)
    assert "RoPE through operators (partial rotary)" in phi.layer_kernels_way()


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe", "mixtral"])
def test_compiled_passes_match_eager(family):
    """torch.compile traces the capped attention (its masked operators) and the MoE block (the whole
    pass, one graph a width) and computes eager's logits; the compiled path really ran."""
    model = tiny_model(family, seed=3)
    eager, compiled = FastModel(model, max_len=64), FastModel(model, max_len=64)
    assert compiled.compile(None)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(4))
    before = graphs_compiled()
    for start, length, n_logits in [(0, 20, 1), (20, 1, 1), (21, 3, 3), (24, 1, 1)]:
        want = eager.forward(ids[start : start + length], start, n_logits)
        got = compiled.forward(ids[start : start + length], start, n_logits)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphs_compiled() - before == 2  # (1, 1) and (4, 4): the compiled passes really ran


@pytest.mark.parametrize("extra", [dict(partial_rotary_factor=1.0, sliding_window=6)], ids=["full-rotary-window"])
def test_phi3_full_rotary_with_a_sliding_window(extra):
    """Phi-3-mini's own shape: every dimension rotated (the C RoPE writer), one sliding window for all
    layers from the config."""
    model = tiny_model("phi3", seed=2, **extra)
    fast = FastModel(model, max_len=64)
    assert fast.windows == [6] * 4 and fast.cache.cos.shape[-1] == 16
    ids = torch.randint(3, 256, (26,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    torch.testing.assert_close(passes_of_every_kind(fast, ids), want, rtol=1e-4, atol=1e-4)


def test_mixtral_with_a_sliding_window():
    """A Mixtral config may set one sliding window for every layer (its attention modules hold none):
    the pass reads the config's and computes transformers' logits past it."""
    model = tiny_model("mixtral", seed=2, sliding_window=6)
    fast = FastModel(model, max_len=64)
    assert fast.windows == [6] * 4 and FastModel(tiny_model("mixtral", seed=2), max_len=8).windows == [None] * 4
    ids = torch.randint(3, 256, (26,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    torch.testing.assert_close(passes_of_every_kind(fast, ids), want, rtol=1e-4, atol=1e-4)


def test_bidirectional_models_and_a_whole_multimodal_model_are_refused_in_one_line():
    """A bidirectional Gemma 3 (an embedding model) is refused, alone or as a multimodal checkpoint's
    language model (from the config, before any weight is read); FastModel handed a whole multimodal
    Gemma 3 model (not its language model: tests/loading/test_gemma3_multimodal.py) says what to hand it."""
    from transformers import AutoModelForCausalLM

    from viasd_core.runtime.families import check_family

    bidirectional = AutoModelForCausalLM.from_config(
        tiny_config("gemma3_text", n_layers=1, use_bidirectional_attention=True))
    with pytest.raises(ViasdError, match="bidirectionally"):
        FastModel(bidirectional, max_len=16)
    with pytest.raises(ViasdError, match="bidirectionally"):
        check_family(multimodal_config(n_layers=1, use_bidirectional_attention=True))
    assert check_family(multimodal_config(n_layers=1)) == "gemma3_text"
    with pytest.raises(ViasdError, match="multimodal gemma3 model: FastModel runs its language model") as err:
        FastModel(AutoModelForCausalLM.from_config(multimodal_config(n_layers=1)), max_len=16)
    assert "\n" not in str(err.value)
