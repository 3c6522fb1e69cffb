"""Whole commands under the CUDA-graph output stand-in: `VIASD_CHECK_GRAPH_OUTPUTS=1` with
`--compile on` on this CPU makes every compiled call poison the outputs of the earlier ones (see
viasd_core/runtime/graph_outputs.py). generate (ar, sd), a three-turn chat, doctor, calibrate and
bench (ar, sd, exact, viasd) run on tiny models and must give the eager run's answers: no command
reads a stale output.

One home for the module, so inductor's on-disk cache is shared by the commands (each compiles
the same small graphs)."""

import json

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.runtime import graph_outputs

N = 8


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """The whole suite compiles many tiny models in one process: start from dynamo's empty cache so
    its recompile limit (a guard for one session's ~12 graphs) counts this module's graphs only."""
    import torch

    torch._dynamo.reset()


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory):
    return tmp_path_factory.mktemp("graph_home")


def invoke(home, monkeypatch, *args, check: bool, input=None):
    """One command in `home`. One thread, and the home's cached measurements (the short-pass product,
    short_products.py): the compared runs take the same paths, not what each one measured."""
    monkeypatch.setenv("VIASD_HOME", str(home))
    if check:
        monkeypatch.setenv(graph_outputs.ENV, "1")
    else:
        monkeypatch.delenv(graph_outputs.ENV, raising=False)
    return CliRunner().invoke(get_app(), [*map(str, args), "--threads", "1"], input=input)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_generate_compiled_under_the_stand_in_equals_eager(tiny_dirs, shared_home, monkeypatch, mode):
    common = ["generate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "-n", N, "--mode", mode, "--json",
              "-q", "w1 w2 w3"]
    eager = invoke(shared_home, monkeypatch, *common, "--compile", "off", check=False)
    before = graph_outputs.checked
    compiled = invoke(shared_home, monkeypatch, *common, "--compile", "on", check=True)
    assert eager.exit_code == 0 and compiled.exit_code == 0, (eager.output, compiled.output)
    assert graph_outputs.checked > before  # compiled calls ran under the check
    got, want = json.loads(compiled.stdout), json.loads(eager.stdout)
    assert (got["text"], got["new_tokens"]) == (want["text"], want["new_tokens"]) and want["new_tokens"] > 0


def test_a_three_turn_chat_compiled_under_the_stand_in_equals_eager(tiny_dirs, shared_home, monkeypatch):
    turns = "w1 w2 w3\nw4 w5\nw6\n"
    common = ["chat", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "-n", N, "--plain"]
    eager = invoke(shared_home, monkeypatch, *common, "--compile", "off", check=False, input=turns)
    before = graph_outputs.checked
    compiled = invoke(shared_home, monkeypatch, *common, "--compile", "on", check=True, input=turns)
    assert eager.exit_code == 0 and compiled.exit_code == 0, (eager.output, compiled.output)
    assert graph_outputs.checked > before
    assert compiled.stdout == eager.stdout and len(eager.stdout.strip().splitlines()) == 3


def test_doctor_compiled_under_the_stand_in_passes(tiny_dirs, shared_home, monkeypatch):
    before = graph_outputs.checked
    result = invoke(shared_home, monkeypatch, "doctor", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"],
                    "--compile", "on", "--json", check=True)
    assert result.exit_code == 0, result.output
    assert graph_outputs.checked > before


def fixed_costs(model, name, block, *args, **kwargs) -> dict:
    """Pass costs as a function of the layers a pass runs and their weight format, instead of
    timings: the fit, hence the thresholds and the held-out runs, then depend only on what the runs
    computed. A packed (int8/int4) layer counts half."""
    seconds = 1e-3 * len(model.layers) * (0.5 if model.weight_format else 1.0)
    return {name: seconds * (1 + 0.1 * block), f"{name}_1": seconds}


def fixed_base_costs(target, draft, block=6, **kwargs) -> dict:
    return {"block": block, **fixed_costs(target, "target", block), "draft": fixed_costs(draft, "draft", 1)["draft"]}


@pytest.fixture(scope="module")
def calibrations(tiny_dirs, shared_home, tmp_path_factory):
    """`viasd calibrate` eager, then compiled under the check (--force: saved whatever the held-out
    fidelity), in the module's home, with pass costs fixed: (eager result, compiled result, guarded
    calls of the compiled run). The profile saved last serves the bench test (exact and viasd)."""
    from viasd_core.calibration import calibrate, candidates

    prompts = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    words = [f"w{i}" for i in range(10, 60)]
    prompts.write_text("\n".join(" ".join(words[i : i + 6]) for i in range(0, 24, 6)) + "\n")
    common = ["calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", prompts, "-n", N,
              "--skip-ratio", "0.5", "--slim-formats", "int8", "--budget", "0.3", "--force", "--json",
              "--threads", "1"]  # one count for both runs: --threads auto follows the load, and rounding with it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibrate, "measure_costs", fixed_base_costs)
        mp.setattr(candidates, "pass_costs", fixed_costs)
        eager = invoke(shared_home, mp, *common, "--compile", "off", check=False)
        before = graph_outputs.checked
        compiled = invoke(shared_home, mp, *common, "--compile", "on", check=True)
        return eager, compiled, graph_outputs.checked - before


def test_calibrate_compiled_under_the_stand_in_records_what_eager_records(calibrations):
    """Every step of a calibration compiled under the check computes what eager computes: the
    calibration text (compiled sd), the slim views' agreement on it (their twins included), the
    gates recorded over compiled runs and the thresholds fitted to them (costs fixed), the held-out
    viasd runs."""
    eager, compiled, checked = calibrations
    assert eager.exit_code == 0 and compiled.exit_code == 0, (eager.output, compiled.output)
    assert checked > 0
    got, want = json.loads(compiled.stdout), json.loads(eager.stdout)
    assert got["layer_ids"] == want["layer_ids"]
    assert got["slim_agreement"] == pytest.approx(want["slim_agreement"], abs=1e-6) and want["slim_agreement"] > 0
    assert len(want["candidates"]) == 3  # the mask on the target's weights; all layers and the mask on int8
    for mine, theirs in zip(got["candidates"], want["candidates"], strict=True):
        for key in ("layer_ids", "weights", "theta_accept", "theta_slim", "theta_confidence", "fit_fidelity"):
            assert mine[key] == theirs[key], key
        for key in ("agreement", "kl", "modeled_tokens_per_s"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert (got["theta_accept"], got["theta_slim"]) == (want["theta_accept"], want["theta_slim"])
    assert any(c["theta_accept"] <= 1 or c["theta_slim"] <= 1 for c in want["candidates"])  # some tier fitted on
    assert got["heldout_fidelity"] == want["heldout_fidelity"] and 0 < want["heldout_fidelity"] <= 1


def test_bench_compiled_under_the_stand_in_equals_eager(tiny_dirs, shared_home, monkeypatch, tmp_path, calibrations):
    """ar, sd, exact and viasd (the profile calibrated above) through bench: the same tokens compiled
    under the check as eager, prompt by prompt."""
    prompts = tmp_path / "spec.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [t]}) + "\n"
                               for i, t in enumerate(["w1 w2 w3 w4 w1 w2 w3", "w9 w8 w7 w9 w8"])))
    rows = {}
    for compile_mode, check in (("off", False), ("on", True)):
        out = tmp_path / compile_mode
        before = graph_outputs.checked
        r = invoke(shared_home, monkeypatch, "bench", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"],
                   "--prompts", prompts, "-n", N, "--methods", "ar,sd,exact,viasd", "--warmup", 0, "--out", out,
                   "--compile", compile_mode, "-q", check=check)
        assert r.exit_code == 0, r.output
        assert (graph_outputs.checked > before) == check
        lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        rows[compile_mode] = {(row["method"], row["prompt_id"]): row["tokens"] for row in lines if row["status"] == "ok"}
    assert {method for method, _ in rows["off"]} == {"ar", "sd", "exact", "viasd"}
    assert rows["on"] == rows["off"]
