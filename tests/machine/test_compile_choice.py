"""`--compile auto|on|off` (viasd_core/machine/compile.py): the rule, the per-machine cache that
`viasd doctor` fills, where nothing is measured, and a real timing on a tiny model."""

import json
import math

import pytest
import torch

from conftest import tiny_model
from viasd_core.machine import compile as compile_choice
from viasd_core.machine.compile import MARGIN, resolve_compile, time_compiled
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_format import INT8
from viasd_core.runtime.weight_formats import apply_weight_format
from viasd_core.errors import UsageError

KEY = {"target": "tiny", "draft": "none", "format": "none", "dtype": "float32", "context": 160}


class Timer:
    """A stand-in for the timing: fixed seconds, and a count of the times it ran."""

    def __init__(self, eager, compiled):
        self.seconds, self.calls = {"eager": eager, "compiled": compiled}, 0

    def __call__(self, model):
        self.calls += 1
        return dict(self.seconds)


def fast(fmt=None) -> FastModel:
    model = tiny_model("llama")
    if fmt is not None:
        apply_weight_format(model, fmt)
    return FastModel(model, max_len=160)


# ---------------------------------------------------------------------- the rule
def test_explicit_choices_and_models_that_never_compile(viasd_home):
    model = fast()
    assert resolve_compile(model, "off", KEY) == compile_choice.CompileChoice(False, "--compile off")
    assert resolve_compile(model, "on", KEY).on
    with pytest.raises(UsageError, match="unknown --compile 'sometimes': use auto, on or off"):
        resolve_compile(model, "sometimes", KEY)
    packed = fast(INT8)  # int8/int4 on a CPU stay eager (exactness), even when asked
    timer = Timer(0.04, 0.01)
    for choice in ("on", "auto"):
        decided = resolve_compile(packed, choice, KEY, measure=True, timer=timer)
        assert not decided.on and decided.reason.startswith("int8/int4 layers on a CPU")
    assert timer.calls == 0 and not packed.compile()


def test_auto_compiles_on_cuda_without_measuring(viasd_home):
    model = fast()
    model.device = torch.device("cuda")  # only the device's kind is read: no pass runs
    timer = Timer(0.01, 0.04)
    decided = resolve_compile(model, "auto", KEY, measure=True, timer=timer)
    assert decided.on and "CUDA graphs" in decided.reason and timer.calls == 0


# ---------------------------------------------------------------------- measured on a CPU, cached
def test_auto_on_a_cpu_stays_eager_until_measured_then_follows_the_cache(viasd_home):
    model = fast()
    timer = Timer(0.040, 0.030)
    first = resolve_compile(model, "auto", KEY, long_lived=True, timer=timer)
    assert not first.on and "not timed on this machine yet" in first.reason and timer.calls == 0
    measured = resolve_compile(model, "auto", KEY, measure=True, long_lived=True, timer=timer)
    assert measured.on and timer.calls == 1
    assert measured.reason == ("auto: compiled, over 5% faster here (eager 40.0 ms, compiled 30.0 ms "
                               "for a 1-token plus a 4-token pass)")
    cached = resolve_compile(model, "auto", KEY, long_lived=True, timer=timer)
    assert cached.on and cached.reason == measured.reason + " (cached)" and timer.calls == 1
    assert cached.seconds == {"eager": 0.040, "compiled": 0.030}
    files = list((viasd_home / "cache" / "machine").iterdir())
    assert len(files) == 1 and files[0].name.startswith("compile-")  # no temporary file left
    saved = json.loads(files[0].read_text())
    assert saved["on"] is True and saved["machine"]["cores"] >= 1 and saved["context"] == 160
    # another context (the compiled pass attends over the whole cache) or thread count: not measured
    assert not resolve_compile(model, "auto", {**KEY, "context": 2048}, long_lived=True, timer=timer).on
    torch.set_num_threads(2 if torch.get_num_threads() != 2 else 1)
    assert not resolve_compile(model, "auto", KEY, long_lived=True, timer=timer).on and timer.calls == 1


def test_a_one_off_command_on_a_cpu_stays_eager_where_compiled_measured_faster(viasd_home):
    model = fast()
    timer = Timer(0.040, 0.030)
    for measure in (True, False):  # doctor's own session, then a later command reading the verdict
        decided = resolve_compile(model, "auto", KEY, measure=measure, timer=timer)
        assert not decided.on and decided.reason.startswith("auto: eager for a one-off command")
        assert "(eager 40.0 ms, compiled 30.0 ms" in decided.reason and decided.seconds["compiled"] == 0.030
    assert timer.calls == 1 and resolve_compile(model, "auto", KEY, long_lived=True).on


def test_serve_opens_a_long_lived_session_and_generate_does_not(monkeypatch, viasd_home):
    from typer.testing import CliRunner

    from viasd_cli import generate, serve
    from viasd_cli.app import get_app
    from viasd_core.errors import UsageError as Stop

    seen = []

    def open_session(opts, config, progress, long_lived=False):
        seen.append(long_lived)
        raise Stop("stopped before loading models")

    for module in (serve, generate):
        monkeypatch.setattr(module, "open_session", open_session)
    runner = CliRunner()
    for args in (["serve", "--port", "0"], ["generate", "hello"]):
        r = runner.invoke(get_app(), args)
        assert r.exit_code == 2 and "stopped before loading models" in r.stderr, r.output
    assert seen == [True, False]


def test_compiled_must_be_faster_by_the_margin(viasd_home):
    model = fast()
    close = Timer(0.040, 0.040 * (1 - MARGIN) + 1e-6)
    decided = resolve_compile(model, "auto", KEY, measure=True, long_lived=True, timer=close)
    assert not decided.on and decided.reason.startswith("auto: eager, compiled is not 5% faster here")
    faster = Timer(0.040, 0.040 * (1 - MARGIN) - 1e-6)
    assert resolve_compile(model, "auto", KEY, measure=True, long_lived=True, timer=faster).on


def test_an_unreadable_cache_stays_eager_and_says_so(viasd_home):
    model = fast()
    resolve_compile(model, "auto", KEY, measure=True, timer=Timer(0.04, 0.01))
    (path,) = (viasd_home / "cache" / "machine").iterdir()
    path.write_text("{not json")
    decided = resolve_compile(model, "auto", KEY)
    assert not decided.on and "could not be read" in decided.reason


# ---------------------------------------------------------------------- a real timing
def test_a_real_timing_measures_both_ways_and_leaves_the_model_as_it_came():
    model = fast()
    seconds = time_compiled(model)
    assert set(seconds) == {"eager", "compiled"} and all(math.isfinite(s) and 0 < s < 5 for s in seconds.values())
    assert not model.compiled
    model.compile()
    with model.eager():
        assert not model.compiled
    assert model.compiled
    time_compiled(model)
    assert model.compiled


def test_the_cli_keeps_inductors_kernels_in_viasds_cache(tmp_path):
    """Importing torch._dynamo fixes inductor's cache folder, so the CLI names it before any command
    imports torch: compiled kernels then outlive a reboot's wipe of the temporary folder."""
    import os
    import subprocess
    import sys

    code = ("import viasd_cli.app as app; app._register(); "
            "from torch._inductor.runtime.cache_dir_utils import cache_dir; print(cache_dir())")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["VIASD_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "cache" / "inductor")


def test_the_bench_records_why_it_ran_compiled_or_not(tiny_dirs, viasd_home, tmp_path):
    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    base = ["bench", "-m", str(tiny_dirs["target"]), "--methods", "ar", "-n", "4", "--threads", "1"]
    for choice, reason in (("off", "--compile off"), ("auto", "auto: eager, since compiling was not timed")):
        r = CliRunner().invoke(get_app(), base + ["--compile", choice, "--out", str(tmp_path / choice)])
        assert r.exit_code == 0, r.stderr
        meta = json.loads((tmp_path / choice / "summary.json").read_text())["meta"]
        assert meta["compile_reason"].startswith(reason) and meta["compiled"] is False
