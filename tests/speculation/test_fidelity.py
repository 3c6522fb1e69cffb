"""Fidelity scores an output against the target as generation runs it (speculation/fidelity.py over
runtime/teacher_forced.py): `ar`, `sd` and `exact` score exactly 1 in every format, a wrong token
costs exactly its share, and the session's own caches are left alone."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, tiny_model
from support.format_cases import engine, quantized
from viasd_core.runtime import teacher_forced
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.speculation.fidelity import fidelity, target_argmax_along

PROMPT = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(11)).tolist()  # a prefill past 16 rows


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
def test_the_exact_modes_score_one_in_every_format(fmt):
    model = tiny_model("llama", n_layers=4, seed=5) if fmt == "none" else quantized("llama", fmt)
    eng = engine(model)
    for mode in ("ar", "sd", "exact"):
        eng.reset()
        out = eng.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=40, gamma=4, adaptive=False))
        assert len(out.tokens) == 40
        seen = eng.target.seen
        assert target_argmax_along(model, PROMPT, out.tokens) == out.tokens, (fmt, mode)
        assert fidelity(model, PROMPT, out.tokens) == 1.0
        assert eng.target.seen == seen  # the engine's cache untouched: the reference has its own


def test_a_wrong_token_costs_its_share_and_the_passes_agree_with_one_row_steps():
    model = quantized("llama", "int4")
    eng = engine(model)
    out = eng.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=33)).tokens
    wrong = out[:10] + [(out[10] + 1) % 200 + 3] + out[11:]
    choice = target_argmax_along(model, PROMPT, wrong)
    assert choice[:11] == out[:11] and choice[10] != wrong[10]
    assert fidelity(model, PROMPT, wrong) == pytest.approx(sum(a == b for a, b in zip(choice, wrong)) / 33, abs=0)
    # the short passes' choices are 1-token steps' choices, position by position (row invariance)
    fast = FastModel(model, max_len=128)
    fast.forward(torch.tensor(PROMPT[:-1]), 0, 1)  # the engine's prefill: up to the last prompt token
    steps = [fast.forward(torch.tensor([tok]), len(PROMPT) - 1 + i, 1).argmax(-1).item()
             for i, tok in enumerate(PROMPT[-1:] + wrong[:-1])]
    assert teacher_forced.choices(FastModel(model, max_len=128), PROMPT, wrong) == steps == choice
    with pytest.raises(ValueError, match="passes"):
        teacher_forced.choices(fast, PROMPT, wrong, passes="two")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_scores_its_own_greedy_output_one(family):
    model = tiny_model(family, n_layers=2, seed=3)
    fast = FastModel(model, max_len=128)
    ids = PROMPT[:20]
    out = []
    fast.forward(torch.tensor(ids[:-1]), 0, 1)
    logits = fast.forward(torch.tensor(ids[-1:]), len(ids) - 1, 1)
    for i in range(12):
        out.append(logits.argmax(-1).item())
        logits = fast.forward(torch.tensor([out[-1]]), len(ids) + i, 1)
    assert fidelity(model, ids, out) == 1.0 and fidelity(model, ids, []) == 1.0
