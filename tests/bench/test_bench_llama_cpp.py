"""The optional `llama.cpp` bench method: skipped with a reason where it cannot run, and a runner
that feeds llama.cpp the prompt's token ids and stops like our engine (EOS or the token budget).

llama-cpp-python builds llama.cpp from source (minutes), so CI does not install it: the runner is
tested against a stand-in module with llama_cpp.Llama's interface, including one whose process dies
by a signal as the native-built package did here (llama_cpp_proc.py); docs/performance.md has the
measured runs with the real package.
"""

import signal
import sys
import types

import pytest

from viasd_core.bench import llama_cpp_proc
from viasd_core.bench.harness import parse_methods
from viasd_core.bench.runners import LlamaCppRunner, Skip, llama_cpp_runner
from viasd_core.errors import ViasdError


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
    module.llama_print_system_info = lambda: b"CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | "
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
    assert runner.build == "CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1"  # the build compared, kept by the bench


def test_the_bench_keeps_the_build_a_method_ran_beside_its_figures():
    from viasd_core.bench.summary import summarize

    statuses = {"ar": {"status": "ok", "reason": None},
                "llama.cpp": {"status": "ok", "reason": None, "build": "CPU : AVX2 = 1"}}
    out = summarize([], statuses, methods=["ar", "llama.cpp"])
    assert out["llama.cpp"]["build"] == "CPU : AVX2 = 1" and "build" not in out["ar"]
    assert llama_cpp_proc.system_info(types.SimpleNamespace()) is None  # a package without the call


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
    assert "scripts/install_llama_cpp.sh" in str(missing)


FAKE_MODULE = """
import os


class Llama:
    def __init__(self, **kwargs):
        if kwargs["model_path"] == "missing.gguf":
            raise ValueError("Failed to load model from file: missing.gguf")
        self.kwargs = kwargs

    def generate(self, tokens, **kwargs):
        yield from [len(tokens), os.getpid(), self.kwargs["n_threads"], 2, 5]


def llama_print_system_info():
    return b"CPU : AVX = 1 | AVX2 = 1 | pid %d | " % os.getpid()
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
        assert runner.build == f"CPU : AVX = 1 | AVX2 = 1 | pid {out.tokens[1]}"  # the child's build line
    finally:
        runner.close()
    assert not runner.llm.proc.is_alive()
    with pytest.raises(ViasdError, match="llama.cpp did not start: ValueError: Failed to load model"):
        LlamaCppRunner("missing.gguf", eos={2}, max_new_tokens=10, n_ctx=64, n_threads=1)


CRASHING_MODULE = """
import os
import signal


class Llama:
    def __init__(self, **kwargs):
        pass

    def generate(self, tokens, **kwargs):
        if len(tokens) > 1:  # as the GCC 12.2 AMX build did on a prompt of several tokens
            os.kill(os.getpid(), signal.SIGSEGV)
        yield from [4, 2]
"""

# the bytes build_note reads in a libggml-cpu: the AMX kernel's symbol and the compiler's .comment
AMX_GCC12 = b"\x7fELF...ggml_backend_amx_mul_mat\x00...GCC: (Debian 12.2.0-14+deb12u1) 12.2.0\x00"


def crashing_package(root, lib: bytes) -> None:
    (root / "llama_cpp" / "lib").mkdir(parents=True)
    (root / "llama_cpp" / "__init__.py").write_text(CRASHING_MODULE)
    (root / "llama_cpp" / "lib" / "libggml-cpu.so").write_bytes(lib)


def test_a_llama_cpp_process_killed_by_a_signal_fails_in_one_line_naming_it_and_the_fix(tmp_path, monkeypatch):
    """llama.cpp's child dies by SIGSEGV on a multi-token prompt: the call raises one line (no
    traceback in the bench: a ViasdError is reported by its message) with the signal, why this build
    crashes (its AMX kernels compiled by GCC 12) and the install script; the dead child closes cleanly."""
    crashing_package(tmp_path, AMX_GCC12)
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = LlamaCppRunner("m.gguf", eos={2}, max_new_tokens=10, n_ctx=64, n_threads=1)
    try:
        assert runner([7]).tokens == [4, 2]  # the child answers until it crashes
        with pytest.raises(ViasdError) as crash:
            runner([1, 5, 6])
    finally:
        runner.close()
    assert crash.value.message == (
        "llama.cpp crashed (signal 11, SIGSEGV) in this build of llama-cpp-python (its AMX kernels were "
        "compiled by GCC 12.2, whose _tile_loadconfig drops the tile configuration): "
        "scripts/install_llama_cpp.sh rebuilds it without -march=native and the AMX kernels")
    assert runner.llm.proc.exitcode == -signal.SIGSEGV


@pytest.mark.parametrize("lib, note", [
    (AMX_GCC12, "its AMX kernels were compiled by GCC 12.2, whose _tile_loadconfig drops the tile configuration"),
    (AMX_GCC12.replace(b"12.2.0-14+deb12u1) 12.2.0", b"13.2.0-4) 13.2.0"), ""),  # a later GCC
    (AMX_GCC12.replace(b"ggml_backend_amx_mul_mat", b"ggml_backend_cpu_mul_mat"), ""),  # no AMX kernels
    (b"ggml_backend_amx_mul_mat\x00clang version 14.0.6\x00", ""),  # clang keeps the tile stores
])
def test_the_build_note_names_gcc_12_amx_kernels_only(tmp_path, lib, note):
    (tmp_path / "libggml-cpu.so.0").write_bytes(lib)
    assert llama_cpp_proc.build_note(tmp_path) == note


def test_a_crash_without_the_known_cause_still_names_the_signal(monkeypatch):
    monkeypatch.setattr(llama_cpp_proc, "library_dir", lambda: None)
    assert llama_cpp_proc.crash_line(-signal.SIGILL) == (
        "llama.cpp crashed (signal 4, SIGILL) in this build of llama-cpp-python: "
        "scripts/install_llama_cpp.sh rebuilds it without -march=native and the AMX kernels")
    assert llama_cpp_proc.crash_line(3) == "llama.cpp's process ended without an answer (exit code 3)"


def test_a_runner_dropped_without_close_ends_its_child_quietly(tmp_path):
    """`viasd bench` (measure.py) hands the runners it made to the harness, which does not close
    them, and drops them: the child is asked to end when its runner goes (or at the parent's exit),
    so no EOFError traceback from the child lands on stderr and no llama.cpp process outlives it."""
    import os
    import subprocess
    import time
    from pathlib import Path

    (tmp_path / "llama_cpp.py").write_text(FAKE_MODULE)
    script = ("from viasd_core.bench.runners import LlamaCppRunner\n"
              "r = LlamaCppRunner('m.gguf', eos={2}, max_new_tokens=4, n_ctx=64, n_threads=1)\n"
              "print(r([1]).tokens[1], flush=True)\n"  # the child's pid (FAKE_MODULE's second token)
              "del r\n"
              "import gc, time\n"
              "gc.collect()\n"
              "time.sleep(2)\n")  # the child's last words, if any, reach stderr before the parent ends
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "EOFError" not in run.stderr
    child = int(run.stdout.split()[-1])
    for _ in range(50):
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":  # ended, not yet reaped by its new parent
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"llama.cpp's child {child} outlived the run")
