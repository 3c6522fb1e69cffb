"""Tiny models in the int8/int4 weight formats and their engines, shared by the formats' and the
packed kernels' tests (a helper module, not a test file)."""

from __future__ import annotations

import torch

from conftest import TinyTokenizer, tiny_model
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import apply_weight_format


def quantized(family="llama", fmt="int4", seed=5, n_layers=4):
    model = tiny_model(family, n_layers=n_layers, seed=seed).to(torch.bfloat16)
    apply_weight_format(model, WeightFormat.parse(fmt))
    return model


def engine(model, slim_layers=(0, 1, 3)):
    return Engine(FastModel(model, max_len=256), TinyTokenizer(),
                  drafter=ModelDrafter(FastModel(model, layer_ids=[0, 1, 3], max_len=256, name="draft"), 256),
                  slim=FastModel(model, layer_ids=list(slim_layers), max_len=256, name="slim"))


def greedy_modes_equal_ar(eng, prompt, new=40):
    eng.reset()
    ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=new))
    for mode in ("sd", "exact"):
        for gamma in (1, 4):
            eng.reset()
            out = eng.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=new, gamma=gamma, adaptive=False))
            assert out.tokens == ar.tokens, (mode, gamma)
            assert out.stats.draft_tokens > 0 and out.stats.acceptance_rate > 0, (mode, gamma)
    return ar
