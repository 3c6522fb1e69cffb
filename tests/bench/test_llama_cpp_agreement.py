"""benchmarks/suites/llama_cpp_agreement.py's scoring: what it counts is what generation would write.

The `short` reading (the continuation in passes of up to 16 positions after a prefill) must count,
position by position, exactly where the model's own 1-token greedy step (what `ar` runs) picks the
given token; the model's own greedy continuation must score every position. llama.cpp itself is not
needed here: the continuation is any token list.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_formats import WeightFormat, apply_weight_format

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "suites" / "llama_cpp_agreement.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("llama_cpp_agreement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["llama_cpp_agreement"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("llama_cpp_agreement", None)


def one_token_choices(fast: FastModel, prompt: list[int], cont: list[int]) -> list[int]:
    """The greedy choice before each position of `cont` as `ar` makes it: the prompt but its last token
    as a prefill, then that token and every continuation token in its own 1-token pass."""
    fast.reset()
    with torch.inference_mode():
        fast.forward(torch.tensor(prompt[:-1]), 0, 1)
        return [int(fast.forward(torch.tensor([tok]), len(prompt) - 1 + i, 1).argmax())
                for i, tok in enumerate(prompt[-1:] + cont[:-1])]


@pytest.mark.parametrize("fmt", ["none", "int4"])
def test_short_passes_score_what_one_token_steps_choose(suite, fmt):
    model = tiny_model("llama", n_layers=2, seed=3)
    if fmt != "none":
        apply_weight_format(model, WeightFormat.parse(fmt))
    fast = FastModel(model, max_len=96)
    prompt = list(range(5, 30))  # 25 tokens: a prefill past the short passes' 16 rows
    own = []  # the model's own greedy continuation, 40 tokens (more than two short passes)
    fast.reset()
    with torch.inference_mode():
        fast.forward(torch.tensor(prompt[:-1]), 0, 1)
        nxt = int(fast.forward(torch.tensor(prompt[-1:]), len(prompt) - 1, 1).argmax())
        for i in range(40):
            own.append(nxt)
            nxt = int(fast.forward(torch.tensor([nxt]), len(prompt) + i, 1).argmax())
    assert one_token_choices(fast, prompt, own) == own
    assert suite.agreement(fast, prompt, own, "short") == len(own)

    g = torch.Generator().manual_seed(0)
    other = [t if torch.rand(1, generator=g) < 0.6 else int(torch.randint(0, 100, (1,), generator=g)) for t in own]
    expected = sum(a == b for a, b in zip(one_token_choices(fast, prompt, other), other))
    assert expected < len(other)  # the altered continuation disagrees somewhere
    assert suite.agreement(fast, prompt, other, "short") == expected


def test_continuations_are_reused_only_for_the_same_prompts(suite, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(suite, "llama_cpp_continuations", lambda g, p, n, t: calls.append(p) or [[1, 2]] * len(p))
    path = tmp_path / "conts.json"
    assert suite.continuations(path, "m.gguf", [[1, 2, 3]], 2, 1) == [[1, 2]]
    assert suite.continuations(path, "m.gguf", [[1, 2, 3]], 2, 1) == [[1, 2]]
    assert len(calls) == 1  # read back, not generated again
    suite.continuations(path, "m.gguf", [[4, 5]], 2, 1)
    assert len(calls) == 2  # other prompts: generated again
    assert not list(tmp_path.glob("*.tmp"))
