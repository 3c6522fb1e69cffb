"""The optional `llama.cpp` bench method: skipped with a reason where it cannot run, and a runner
that feeds llama.cpp the prompt's token ids and stops like our engine (EOS or the token budget).

llama-cpp-python builds llama.cpp from source (minutes), so CI does not install it: the runner is
tested against a stand-in module with llama_cpp.Llama's interface; docs/performance.md has the
measured runs with the real package.
"""

import sys
import types

import pytest

from viasd_core.bench.harness import parse_methods
from viasd_core.bench.runners import LlamaCppRunner, Skip, llama_cpp_runner


class FakeLlama:
    made: list[dict] = []

    def __init__(self, **kwargs):
        FakeLlama.made.append(kwargs)
        self.resets = 0
        self.fed = None

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **kwargs):
        self.fed = (list(tokens), kwargs)
        yield from [7, 8, 9, 2, 11, 12]


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    module.__spec__ = types.SimpleNamespace(name="llama_cpp")
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    FakeLlama.made.clear()
    return module


def test_method_name_parses():
    assert parse_methods("ar,llama.cpp") == ["ar", "llama.cpp"]


def test_runner_feeds_the_prompt_ids_greedily_and_stops_at_eos(fake_llama_cpp):
    runner = LlamaCppRunner("model.gguf", eos={2}, max_new_tokens=10, n_ctx=512, n_threads=2)
    made = FakeLlama.made[-1]
    assert made["model_path"] == "model.gguf" and made["n_threads"] == 2 and made["n_gpu_layers"] == 0
    runner.reset()
    out = runner([1, 5, 6])
    assert out.tokens == [7, 8, 9, 2] and out.finish_reason == "eos"
    assert out.target_passes == 4 and out.accepted_lengths == [1, 1, 1, 1]
    fed, kwargs = runner.llm.fed
    assert fed == [1, 5, 6] and kwargs["temp"] == 0.0 and kwargs["top_k"] == 1 and kwargs["repeat_penalty"] == 1.0
    assert runner.llm.resets == 1


def test_runner_stops_at_the_token_budget(fake_llama_cpp):
    out = LlamaCppRunner("m.gguf", eos={99}, max_new_tokens=3, n_ctx=64, n_threads=1)([1])
    assert out.tokens == [7, 8, 9] and out.finish_reason == "length"


def test_skipped_with_a_reason_without_the_package_or_a_gguf(monkeypatch, fake_llama_cpp):
    other = llama_cpp_runner("some/other-model", {2}, 8, 64)
    assert isinstance(other, Skip) and "GGUF" in str(other)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    missing = llama_cpp_runner("smollm2-135m", {2}, 8, 64)
    assert isinstance(missing, Skip) and "pip install llama-cpp-python" in str(missing)
