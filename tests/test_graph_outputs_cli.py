"""Whole commands under the CUDA-graph output stand-in: `VIASD_CHECK_GRAPH_OUTPUTS=1` with
`--compile on` on this CPU makes every compiled call poison the outputs of the earlier ones (see
viasd_core/decoding/graph_outputs.py). generate in every exact mode, a three-turn chat and doctor
run on tiny models and must give the eager run's answers: no command reads a stale output.

One home for the module, so inductor's on-disk cache is shared by the commands (each compiles
the same small graphs)."""

import json

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.decoding import graph_outputs

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
    monkeypatch.setenv("VIASD_HOME", str(home))
    if check:
        monkeypatch.setenv(graph_outputs.ENV, "1")
    else:
        monkeypatch.delenv(graph_outputs.ENV, raising=False)
    return CliRunner().invoke(get_app(), [*map(str, args)], input=input)


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
