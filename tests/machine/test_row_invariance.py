"""Row invariance, the property `sd == ar` rests on: a position's logits do not depend on how many
other rows share its pass. For every format the engine promises exact on a CPU (float32, bfloat16,
int8, int4), every family, at 1 and 2 threads, with viasd's C kernels built and with none of them
(no compiler: every fallback), each row of a chain pass of any width 1-16 and of a token tree's pass
equals, bit for bit, the same position decoded alone. bitsandbytes' CPU formats are not promised
(their kernels round by row count): the model says so (`row_attention` off) and the test checks that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FAMILIES
from support.invariance_cases import FORMATS, PROMPT, SPAN, target, tokens, width_dependent_rows
from viasd_core import cpu_isa, paths
from viasd_core.speculation.exactness import note, promise
from viasd_core.runtime.model import FastModel
from viasd_kernels import cpu_f32_mm, cpu_packed_mm, cpu_row_attention, instruction_set

@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """No C kernel can be built (no compiler, a fresh kernels folder): every pass takes its
    fallbacks, as on a machine without a compiler or without the instructions a kernel needs."""
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    paths._cache_dirs.cache_clear()
    yield
    paths._cache_dirs.cache_clear()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_logits_do_not_depend_on_its_pass(family, fmt, threads):
    torch.set_num_threads(threads)
    fast = target(family, fmt)
    assert fast.row_attention
    assert width_dependent_rows(fast, tokens(PROMPT + SPAN + 8, seed=threads)) == {}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rows_stay_invariant_without_any_c_kernel(family, fmt, no_compiler):
    torch.set_num_threads(2)
    fast = target(family, fmt)
    assert width_dependent_rows(fast, tokens(PROMPT + SPAN + 8, seed=5)) == {}
    # and the fallbacks did run: no kernel was built for this folder
    assert cpu_f32_mm.bind(torch.zeros(16, 16), build_dir=paths.kernel_dir()) is None
    assert cpu_row_attention.row_attention(*[torch.zeros(1, 1, 1, 16)] * 3, 1, build_dir=paths.kernel_dir()) is None


def test_the_check_finds_a_width_dependent_product(monkeypatch):
    """The test above can fail: F.linear's own float32 rows (the products before they were made
    row-invariant) round by the pass's width at 2 threads."""
    from viasd_core.runtime import short_products

    torch.set_num_threads(2)
    fast = target("llama", "float32")
    fast.bind_kernels(layer_front=False)  # the products through the patched call below, not the front's C calls
    monkeypatch.setattr(short_products, "_invariant_linear", lambda x, layer, kernel, residual=None: (
        0 if residual is None else residual) + layer(x * (1 + 1e-6 * (x.numel() > x.shape[-1]))))
    assert width_dependent_rows(fast, tokens(PROMPT + SPAN + 8)) != {}


def test_bitsandbytes_formats_are_not_promised_row_invariant():
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from conftest import save_tiny_model_dir

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_tiny_model_dir(d)
        model = AutoModelForCausalLM.from_pretrained(d, quantization_config=BitsAndBytesConfig(
            load_in_8bit=True, llm_int8_threshold=0.0), device_map={"": "cpu"})
    fast = FastModel(model, max_len=64)
    assert fast.quantized and not fast.row_attention and not fast.pass_rows.invariant
    assert not promise(fast).exact and "bitsandbytes" in promise(fast).why


@pytest.mark.parametrize("fmt", FORMATS)
def test_what_is_promised_follows_how_the_model_runs(fmt):
    fast = target("llama", fmt)
    assert promise(fast).exact and note(fast, "sd") is None
    fast.row_attention = False  # as a slim view runs
    assert not promise(fast).exact and not fast.pass_rows.invariant
    fast.row_attention = True
    assert fast.pass_rows.invariant
    if fast.compilable:
        fast.compile()
        assert not promise(fast).exact and "compiled" in promise(fast).why
        assert note(fast, "sd").startswith("note: sd may differ from ar") and note(fast, "ar") is None


def _report_under_this_cap() -> None:
    """Run in a process started with VIASD_MAX_CPU_ISA set: what runs, and the width-dependent rows
    of each format at 2 threads, as one JSON line."""
    torch.set_num_threads(2)
    out = {"isa": instruction_set.isa_class(), "aten": torch.backends.cpu.get_cpu_capability(),
           "packed_mm": cpu_packed_mm.way(paths.kernel_dir()),
           "f32_mm": cpu_f32_mm.bind(torch.zeros(16, 16), build_dir=paths.kernel_dir()) is not None,
           "mkl": os.environ.get("MKL_ENABLE_INSTRUCTIONS")}
    torch.randn(8, 8) @ torch.randn(8, 8)  # MKL's first call: with MKL_VERBOSE=1 it names the code path it took
    for fmt in FORMATS:
        out[fmt] = width_dependent_rows(target("qwen2", fmt), tokens(PROMPT + SPAN + 8, seed=9))
    print(json.dumps(out, default=str))


@pytest.mark.parametrize("cap", ["avx2", "avx512"])
def test_each_instruction_set_class_is_row_invariant(cap, tmp_path):
    """VIASD_MAX_CPU_ISA makes this CPU build viasd's kernels, and dispatch PyTorch's, as a CPU of the
    lower class would: each class below this CPU's is checked here, whatever CPU runs the tests."""
    env = {**os.environ, "VIASD_MAX_CPU_ISA": cap, "VIASD_HOME": str(tmp_path / "home"), "MKL_VERBOSE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    code = "import test_row_invariance as t; t._report_under_this_cap()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    own = instruction_set.cpu_isa_class()
    want = min(own, cap, key=instruction_set.ISA_CLASSES.index) if own in instruction_set.ISA_CLASSES else own
    assert report["isa"] == want
    if want in ("avx2", "avx512"):  # the packed products' portable way (their BF16 way needs AVX-512 BF16)
        assert report["aten"] == want.upper() and report["packed_mm"] == cpu_packed_mm.PORTABLE_WAY
    assert report["f32_mm"]  # the float32 product builds for every class (portable C)
    if want in cpu_isa.MKL:  # MKL (float32 products) capped too; it names its code path where it obeys (Intel CPUs)
        assert report["mkl"] == cpu_isa.MKL[want]
        mkl_line = next((l for l in done.stdout.splitlines() if l.startswith("MKL_VERBOSE oneMKL")), "")
        cpuinfo = Path("/proc/cpuinfo")  # Linux only: elsewhere the CPU's maker is not read, and MKL's line not checked
        if torch.backends.mkl.is_available() and cpuinfo.is_file() and "GenuineIntel" in cpuinfo.read_text():
            named = {"avx2": "(Intel(R) AVX2) enabled", "avx512": "(Intel(R) DL Boost), ", "avx512_bf16": "and bfloat16, "}
            assert named[want] in mkl_line, mkl_line
    assert {fmt: report[fmt] for fmt in FORMATS} == {fmt: {} for fmt in FORMATS}
