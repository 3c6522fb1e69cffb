"""benchmarks/suites/serve_load.py's load, small, on the byte-level tiny pair: several openai clients
at once over fewer slots than clients, every kind of request (short, long, streamed, tool calls
streamed or not, JSON schema); every answer equals the same request sent alone, and every JSON
answer validates. Timings are reported by the script, not asserted here."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest

from support.serve_support import byte_session, running  # noqa: F401 (fixture)
from viasd_core.speculation.engine import GenerationConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "suites" / "serve_load.py"
PROMPTS = ["What is the weather in Paris?", "Rain in Rome tomorrow?", "Oslo, three days.", "Say hi."]


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("serve_load", None)


def test_answers_under_load_equal_the_solo_answers(byte_session, load, viasd_home):  # noqa: F811
    budgets = load.Budgets(short=6, long=40, stream=24, call=150)
    todo = load.plan(3, 4, len(PROMPTS))
    with running(byte_session, GenerationConfig(mode="sd", max_new_tokens=64), slots=2) as (base, server):
        metrics, peak = server.worker.metrics, []
        counted = metrics.set_running
        metrics.set_running = lambda n: (peak.append(n), counted(n))
        result = load.run_load(base, PROMPTS, clients=3, requests=4, budgets=budgets)
        assert server.worker.jobs_run == 1 + len({k for row in todo for k in row}) + 12  # warm-up, solo, load
    assert max(peak) == 2  # requests ran beside each other, on both slots, and never more than the slots
    assert result["answers"] == 12 and result["equal"] == 12, result["mismatches"]
    assert result["invalid_json"] == [] and result["json_checked"] > 0
    assert set(result["latency"]) == set(load.KINDS)  # the plan covers every kind
    shorts = sum(kind == "short" for row in todo for kind, _ in row)
    assert result["latency"]["short"]["count"] == shorts and result["latency"]["short"]["load_p95_s"] > 0


def test_the_checks_catch_a_different_answer_and_an_invalid_one(load):
    """The checks are not vacuous: a loaded answer that differs, and JSON that breaks its schema, are reported."""
    base = {"content": None, "calls": [], "finish": "stop", "tokens": 3, "latency_s": 0.1}
    solo = {("json", 0): {**base, "kind": "json", "prompt": 0, "content": '{"city": "Rome", "rain": true, "degrees": 20}'},
            ("tools", 1): {**base, "kind": "tools", "prompt": 1, "finish": "tool_calls",
                           "calls": [["weather", '{"city": "Oslo", "days": 2}']]},
            ("short", 2): {**base, "kind": "short", "prompt": 2, "content": "hello"}}
    good = list(copy.deepcopy(solo).values())
    assert load.check(solo, good)["mismatches"] == [] and load.check(solo, good)["invalid_json"] == []
    differs = copy.deepcopy(good)
    differs[2]["content"] = "hello!"
    assert [m["kind"] for m in load.check(solo, differs)["mismatches"]] == ["short"]
    out_of_schema = copy.deepcopy(good)
    out_of_schema[0]["content"] = '{"city": "Rome", "rain": true, "degrees": 99}'
    out_of_schema[1]["calls"] = [["weather", '{"city": "Oslo"}']]
    bad = load.check(solo, out_of_schema)
    assert sorted(b["kind"] for b in bad["invalid_json"]) == ["json", "tools"] and len(bad["mismatches"]) == 2
    assert load.p95([float(i) for i in range(1, 21)]) == 19.0 and load.p95([4.0]) == 4.0
