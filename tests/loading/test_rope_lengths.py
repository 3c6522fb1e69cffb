"""RoPE types whose frequencies change with the length (longrope: Phi-3 128k, Phi-3.5, Phi-4-mini;
dynamic NTK) run up to the context where they are one fixed table, and no further.

transformers switches longrope to its long factors once a call's last position passes
`original_max_position_embeddings`; up to it viasd's table must be the short one (with the
attention factor), and the model's context for viasd stops there, with the reason.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TinyTokenizer, tiny_model
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.families import model_shape
from viasd_core.runtime.model import FastModel
from viasd_core.errors import UsageError, ViasdError
from viasd_core.session import context_size

ORIGINAL = 64  # longrope's original context in these tiny models
NEW = 40


def longrope_phi3(seed=11, n_layers=4):
    # phi3's tiny config rotates 12 of each head's 16 dimensions: 6 factors each
    return tiny_model("phi3", seed=seed, n_layers=n_layers, max_position_embeddings=512, original_max_position_embeddings=ORIGINAL,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                       "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
                                       "original_max_position_embeddings": ORIGINAL})


def dynamic_llama(seed=11, n_layers=4):
    return tiny_model("llama", seed=seed, n_layers=n_layers, max_position_embeddings=ORIGINAL,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})


def hf_greedy(model, prompt, new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt(seed=0, n=12):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("build", [longrope_phi3, dynamic_llama], ids=["longrope", "dynamic"])
def test_greedy_equals_transformers_and_sd_equals_ar_within_the_original_context(build):
    target, draft = build(), build(seed=99, n_layers=1)
    fast = FastModel(target, max_len=ORIGINAL)
    assert fast.shape.max_positions == ORIGINAL
    for s in range(2):
        p = prompt(s)
        assert len(p) + NEW <= ORIGINAL
        ref = hf_greedy(target, p, NEW)
        ar = Engine(FastModel(target, max_len=ORIGINAL), TinyTokenizer()).generate(
            p, GenerationConfig(mode="ar", max_new_tokens=NEW))
        assert ar.tokens == ref
        drafter = ModelDrafter(FastModel(draft, max_len=ORIGINAL, name="draft"), vocab_size=fast.shape.vocab_size)
        sd = Engine(FastModel(target, max_len=ORIGINAL), TinyTokenizer(), drafter=drafter).generate(
            p, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3))
        assert sd.tokens == ref


def test_longrope_tables_are_the_short_factors_even_in_a_longer_cache():
    """A cache longer than the original context still reads the short table for the positions it runs
    (transformers' table over a longer call would be the long one: the two differ, so this can fail)."""
    target = longrope_phi3()
    rotary = target.get_decoder().rotary_emb
    dummy = torch.zeros(1)
    short_cos, _ = rotary(dummy, torch.arange(ORIGINAL)[None])
    long_cos, _ = rotary(dummy, torch.arange(2 * ORIGINAL)[None])
    assert not torch.equal(short_cos[0, 1:ORIGINAL], long_cos[0, 1:ORIGINAL])
    fast = FastModel(target, max_len=2 * ORIGINAL)
    assert torch.equal(fast.cache.cos[:ORIGINAL], short_cos[0])


def test_the_context_stops_at_the_original_one_with_the_reason():
    target = longrope_phi3()
    shape = model_shape(target)
    assert shape.max_positions == ORIGINAL and "longrope" in shape.positions_why
    assert context_size(target, None) <= ORIGINAL
    with pytest.raises(UsageError, match=rf"exceeds the model's context \({ORIGINAL} positions: its 'longrope' RoPE"):
        context_size(target, ORIGINAL + 1)
    plain = tiny_model("phi3")
    assert model_shape(plain).max_positions == 512 and model_shape(plain).positions_why == ""


def test_an_unknown_rope_type_is_still_refused_in_one_line():
    target = tiny_model("llama")
    target.config.rope_parameters = {"rope_type": "made-up", "rope_theta": 10000.0}
    with pytest.raises(ViasdError, match="RoPE type 'made-up' is not supported") as err:
        model_shape(target)
    assert "\n" not in str(err.value)
