"""`--quant auto` chosen by timing this machine (viasd_core/machine/format.py): the rule on synthetic
timings, the cache (per model and machine, dropped by doctor), where auto does not measure at all,
and a real timing of every candidate on a tiny model."""

import importlib.util
import json
import math

import torch

from viasd_core.machine import format as format_choice
from viasd_core.runtime.weight_format import INT4, INT8, NONE
from viasd_core.machine.format import TIE, choose_format, pick
from viasd_core.loading.models import forget_format, format_loader, resolve_format

from conftest import needs_torchao
CPU = torch.device("cpu")
CANDIDATES = (NONE, INT8, INT4)


class Timer:
    """A stand-in for the timing: fixed seconds per format, and a count of the times it ran."""

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, 0

    def __call__(self, ref, candidates, device):
        self.calls += 1
        assert tuple(candidates) == tuple(self.seconds) and device == CPU
        return dict(self.seconds)


# ---------------------------------------------------------------------- the rule
def test_the_fastest_format_wins_and_its_reason_shows_every_timing():
    fmt, why = pick({NONE: 0.140, INT8: 0.045, INT4: 0.038})
    assert fmt is INT4
    assert why == "int4: the fastest here (none 140.0 ms, int8 45.0 ms, int4 38.0 ms for a 1-token plus a 4-token pass)"
    assert pick({NONE: 0.140, INT8: 0.030, INT4: 0.038})[0] is INT8  # a CPU whose int4 kernel is slow
    assert pick({NONE: 0.020, INT8: 0.030, INT4: 0.038})[0] is NONE


def test_a_more_precise_format_within_the_tie_wins():
    fmt, why = pick({NONE: 0.140, INT8: 0.0400 * (1 + TIE) - 1e-6, INT4: 0.0400})
    assert fmt is INT8 and why.startswith("int8: within 5% of the fastest and more precise here")
    assert pick({NONE: 0.140, INT8: 0.0400 * (1 + TIE) + 1e-6, INT4: 0.0400})[0] is INT4


# ---------------------------------------------------------------------- the cache
def test_the_choice_is_measured_once_then_read_from_the_cache(viasd_home, monkeypatch):
    timer = Timer({NONE: 0.14, INT8: 0.03, INT4: 0.04})
    first = choose_format("smollm2-135m", CPU, CANDIDATES, timer=timer)
    assert first.format is INT8 and timer.calls == 1 and first.seconds == {"none": 0.14, "int8": 0.03, "int4": 0.04}
    again = choose_format("smollm2-135m", CPU, CANDIDATES, timer=timer)
    assert again.format is INT8 and timer.calls == 1 and again.reason == first.reason + " (cached)"
    files = list((viasd_home / "cache" / "machine").iterdir())
    assert [f.name for f in files] == [format_choice.cache_record("smollm2-135m", CPU).path.name]  # no temporary file left
    saved = json.loads(files[0].read_text())
    assert saved["format"] == "int8" and saved["machine"]["cores"] >= 1 and "cpu_capability" in saved["machine"]

    # another thread count, another CPU (its instruction set): measured again
    torch.set_num_threads(2 if torch.get_num_threads() != 2 else 1)
    choose_format("smollm2-135m", CPU, CANDIDATES, timer=timer)
    assert timer.calls == 2
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-ELSEWHERE")
    choose_format("smollm2-135m", CPU, CANDIDATES, timer=timer)
    assert timer.calls == 3


def test_an_unreadable_or_foreign_cache_is_measured_again(viasd_home):
    timer = Timer({NONE: 0.14, INT8: 0.03, INT4: 0.04})
    path = format_choice.cache_record("smollm2-135m", CPU).path
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert choose_format("smollm2-135m", CPU, CANDIDATES, timer=timer).format is INT8 and timer.calls == 1
    fewer = Timer({NONE: 0.14})  # other candidates (torchao gone): the cached choice does not apply
    assert choose_format("smollm2-135m", CPU, (NONE,), timer=fewer).format is NONE and fewer.calls == 1


def test_doctor_drops_the_cached_choice(viasd_home, monkeypatch):
    timer = Timer({NONE: 0.14, INT8: 0.03, INT4: 0.04})
    monkeypatch.setattr(format_choice, "measure", timer)
    assert resolve_format("auto", "embedded", CPU, None)[0] is INT8 and timer.calls == 1
    assert resolve_format("auto", "smollm2-135m", CPU, None)[1].endswith("(cached)") and timer.calls == 1
    forget_format("SmolLM2-135M", "cpu")  # any alias of the model
    timer.seconds = {NONE: 0.14, INT8: 0.05, INT4: 0.04}
    fmt, why = resolve_format("auto", "smollm2-135m", CPU, None)
    assert fmt is INT4 and timer.calls == 2 and not why.endswith("(cached)")


# ---------------------------------------------------------------------- where auto does not measure
def test_auto_measures_only_a_model_whose_formats_quality_was_measured_on_a_cpu(viasd_home, monkeypatch):
    timer = Timer({NONE: 0.14, INT8: 0.03, INT4: 0.04})
    monkeypatch.setattr(format_choice, "measure", timer)
    assert resolve_format("auto", "smollm2-135m", torch.device("cuda"), None) == (NONE, "none: not measured on cuda")
    fmt, why = resolve_format("auto", "smollm2-135m", CPU, "float32")
    assert fmt is NONE and "--dtype float32" in why
    fmt, why = resolve_format("auto", "org/other-model", CPU, None)
    assert fmt is NONE and why.startswith("none: auto picks a low-bit format only for the embedded target")
    assert resolve_format("int4", "org/other-model", CPU, None) == (INT4, "int4: asked for")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    fmt, why = resolve_format("auto", "smollm2-135m", CPU, None)
    assert fmt is NONE and why.startswith("none: torchao is not installed")
    assert timer.calls == 0


# ---------------------------------------------------------------------- a real timing
@needs_torchao
def test_every_candidate_is_loaded_and_timed(tiny_dirs):
    seconds = format_choice.measure(format_loader(str(tiny_dirs["target"]), CPU), CANDIDATES, CPU)
    assert list(seconds) == list(CANDIDATES)
    assert all(math.isfinite(s) and 0 < s < 5 for s in seconds.values()), seconds


# ---------------------------------------------------------------------- shown to the user
def test_verbose_says_what_was_chosen_and_why_on_stderr_only(tiny_dirs, viasd_home):
    from typer.testing import CliRunner

    from viasd_cli.app import get_app

    runner = CliRunner()
    base = ["generate", "hello world", "--model", str(tiny_dirs["target"]), "--device", "cpu", "-n", "8",
            "--draft", "ngram", "--threads", "1"]
    plain = runner.invoke(get_app(), base)
    verbose = runner.invoke(get_app(), base + ["--verbose"])
    assert plain.exit_code == 0 and verbose.exit_code == 0, (plain.output, verbose.output)
    assert verbose.stdout == plain.stdout and verbose.stdout.strip()
    said = verbose.stderr.splitlines()
    assert "weights: none (auto picks a low-bit format only for the embedded target (not measured on other models))" in said
    assert "threads: 1 (--threads 1)" in said
    assert "compile: off (auto: eager, since compiling was not timed on this machine yet (`viasd doctor` with the same --quant and --max-context times it))" in said
    assert any(line.startswith("tree: chains (") for line in said), said
    assert not any(line.startswith(("weights:", "threads:")) for line in plain.stderr.splitlines())
