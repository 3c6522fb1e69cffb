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
    runner = LlamaCppRunner("model.gguf", eos={2}, max_new_tokens=10, n_ctx=512, n_threads=2, own_process=False)
    made = FakeLlama.made[-1]
    assert made["model_path"] == "model.gguf" and made["n_threads"] == 2 and made["n_gpu_layers"] == 0
    runner.reset()
    out = runner([1, 5, 6])
    assert out.tokens == [7, 8, 9, 2] and out.finish_reason == "eos"
    assert out.target_passes == 4 and out.accepted_lengths == [1, 1, 1, 1]
    fed, kwargs = runner.llm.llm.fed
    assert fed == [1, 5, 6] and kwargs["temp"] == 0.0 and kwargs["top_k"] == 1 and kwargs["repeat_penalty"] == 1.0
    assert runner.llm.llm.resets == 1


def test_runner_stops_at_the_token_budget(fake_llama_cpp):
    out = LlamaCppRunner("m.gguf", eos={99}, max_new_tokens=3, n_ctx=64, n_threads=1, own_process=False)([1])
    assert out.tokens == [7, 8, 9] and out.finish_reason == "length"


def test_skipped_with_a_reason_without_the_package_or_a_gguf(monkeypatch, fake_llama_cpp):
    other = llama_cpp_runner("some/other-model", {2}, 8, 64)
    assert isinstance(other, Skip) and "GGUF" in str(other)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    missing = llama_cpp_runner("smollm2-135m", {2}, 8, 64)
    assert isinstance(missing, Skip) and "pip install llama-cpp-python" in str(missing)


FAKE_MODULE = """
import os


class Llama:
    def __init__(self, **kwargs):
        if kwargs["model_path"] == "missing.gguf":
            raise ValueError("Failed to load model from file: missing.gguf")
        self.kwargs = kwargs

    def generate(self, tokens, **kwargs):
        yield from [len(tokens), os.getpid(), self.kwargs["n_threads"], 2, 5]
"""


def test_by_default_llama_cpp_answers_from_a_process_of_its_own(tmp_path, monkeypatch):
    """The runner's default: a spawned child (llama_cpp_proc.OwnProcess) loads llama_cpp there and
    answers each prompt over a pipe, the same greedy loop; a model that does not load is one line."""
    import os

    (tmp_path / "llama_cpp.py").write_text(FAKE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned child starts from the parent's sys.path
    runner = LlamaCppRunner("m.gguf", eos={2}, max_new_tokens=10, n_ctx=64, n_threads=3)
    try:
        out = runner([1, 5, 6])
        assert out.tokens[0] == 3 and out.tokens[2:] == [3, 2] and out.finish_reason == "eos"
        assert out.tokens[1] != os.getpid()  # generated in another process
        assert runner([4]).tokens[0] == 1  # the next prompt on the same child
    finally:
        runner.close()
    assert not runner.llm.proc.is_alive()
    with pytest.raises(RuntimeError, match="llama.cpp did not start: ValueError: Failed to load model"):
        LlamaCppRunner("missing.gguf", eos={2}, max_new_tokens=10, n_ctx=64, n_threads=1)
