"""`--threads auto|N` (viasd_core/machine/threads.py): the count a session's passes use, timed at start-up."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.machine import threads
from viasd_core.errors import UsageError
from viasd_core.machine.threads import candidates, parse_threads, pick, resolve_threads


def test_the_option_parses_auto_and_counts_and_refuses_the_rest():
    assert parse_threads("auto") == "auto" and parse_threads(" AUTO ") == "auto" and parse_threads("3") == 3
    for bad in ("0", "-1", "two", "1.5", ""):
        with pytest.raises(UsageError, match="--threads must be auto or a thread count"):
            parse_threads(bad)


def test_the_counts_tried_are_powers_of_two_and_every_core():
    assert candidates(1) == [1] and candidates(2) == [1, 2] and candidates(6) == [1, 2, 4, 6]
    assert candidates(8) == [1, 2, 4, 8]


def test_the_fewest_threads_within_the_tie_win():
    assert pick({1: 0.050, 2: 0.030}) == 2
    assert pick({1: 0.031, 2: 0.030}) == 1  # within 5%: one thread does as well and leaves a core free
    assert pick({1: 0.040, 2: 0.030, 4: 0.0295}) == 2
    assert not threads.ThreadChoice(1, "auto", {1: 0.031, 2: 0.030}).busy  # a near-tie is no busy machine


def _step_on(machine: dict[int, float], calls: list[int]):
    """A probe pass whose seconds depend on torch's thread count, as on a machine of those timings."""

    def step(repeats: int) -> float:
        calls.append((torch.get_num_threads(), repeats))
        return machine[torch.get_num_threads()]

    return step


@pytest.mark.parametrize("machine, chosen", [
    ({1: 0.029, 2: 1.25}, 1),  # another job holds a core: 2 threads wait at every parallel region
    ({1: 0.029, 2: 0.017}, 2),  # an idle machine
])
def test_auto_keeps_the_fastest_count_measured_now(monkeypatch, machine, chosen):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    calls: list = []
    choice = resolve_threads("auto", torch.device("cpu"), _step_on(machine, calls))
    assert choice.threads == chosen and torch.get_num_threads() == chosen
    assert choice.seconds == machine and calls == [(1, 1), (1, 3), (2, 1), (2, 3)]  # an unmeasured run, then 3
    assert choice.busy == (chosen == 1)  # 2 threads 43x slower than 1: said; the idle machine's choice is not
    assert f"{machine[1] * 1e3:.1f} ms" in choice.reason and choice.to_dict()["seconds"] == {"1": machine[1], "2": machine[2]}


def test_a_count_is_set_as_given_and_a_gpu_or_one_core_measures_nothing(monkeypatch):
    calls: list = []
    step = _step_on({1: 0.1, 2: 0.1, 3: 0.1}, calls)
    assert resolve_threads("3", torch.device("cpu"), step).threads == 3 and torch.get_num_threads() == 3
    before = torch.get_num_threads()
    gpu = resolve_threads("auto", torch.device("cuda"), step)
    assert gpu.threads == before and "GPU" in gpu.reason
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert resolve_threads("auto", torch.device("cpu"), step).threads == 1 and torch.get_num_threads() == 1
    assert calls == []


def test_sessions_resolve_threads_and_say_when_a_busy_machine_gets_fewer(tiny_dirs, viasd_home, monkeypatch):
    def run(*extra):
        r = CliRunner().invoke(get_app(), ["generate", "w1 w2 w3", "-m", str(tiny_dirs["target"]), "--mode", "ar",
                                           "-n", "4", "--json", *extra])
        assert r.exit_code == 0, r.stderr
        return r

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    measured = []
    monkeypatch.setattr(threads, "measure", lambda step, counts: measured.append(counts) or {1: 0.010, 2: 0.050})
    assert "CPU threads: 1 of 2 (auto: fastest of the counts measured now (1: 10.0 ms, 2: 50.0 ms" in run().stderr
    assert measured == [[1, 2]] and torch.get_num_threads() == 1
    monkeypatch.setattr(threads, "measure", lambda step, counts: {1: 0.050, 2: 0.010})
    assert "CPU threads" not in run().stderr and torch.get_num_threads() == 2  # all cores: nothing to say
    assert "CPU threads" not in run("--threads", "1").stderr and torch.get_num_threads() == 1
    r = CliRunner().invoke(get_app(), ["generate", "x", "-m", str(tiny_dirs["target"]), "--threads", "many"])
    assert r.exit_code != 0 and r.stderr.count("\n") == 1 and "--threads must be" in r.stderr


def test_a_real_probe_times_the_targets_passes(tiny_dirs, viasd_home, monkeypatch):
    """Unpatched, auto runs the session's own target passes at every count it tries."""
    from viasd_core.loading.options import ModelOptions
    from viasd_core.session import build_session

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), max_context=64), mode="ar")
    assert set(session.threads.seconds) == {1, 2} and all(0 < s < 5 for s in session.threads.seconds.values())
    assert torch.get_num_threads() == session.threads.threads == pick(session.threads.seconds)
    assert session.engine.target.seen == 0  # the probe leaves an empty cache behind


def test_the_bench_records_the_count_every_method_ran_with(tiny_dirs, viasd_home, tmp_path):
    r = CliRunner().invoke(get_app(), ["bench", "-m", str(tiny_dirs["target"]), "--methods", "ar", "-n", "4",
                                       "--threads", "1", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.stderr
    meta = json.loads((tmp_path / "b" / "summary.json").read_text())["meta"]
    assert meta["threads"] == {"threads": 1, "reason": "--threads 1", "seconds": {}} and meta["torch_threads"] == 1
