"""`viasd bench --quant A,B --out DIR`: one bench process per format, combined against fp32."""

import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.bench.formats import combine, format_request, main, run_format, run_formats, split_formats
from viasd_core.bench.harness import BenchConfig
from viasd_core.bench.measure import PromptSource
from viasd_core.errors import UsageError, ViasdError
from viasd_core.loading.options import ModelOptions


def summary(tps: dict[str, float], status="ok"):
    return {"methods": {m: {"status": status, "reason": None, "tokens_per_s_mean": t, "mean_accepted_length": 1.5,
                            "fidelity_mean": 1.0, "peak_memory_bytes": 2**30} for m, t in tps.items()}}


def test_split_formats():
    assert split_formats("int4") is None
    assert split_formats("none, int4,int4") == ["none", "int4"]
    with pytest.raises(UsageError, match="unknown format 'int3'"):
        split_formats("none,int3")


def test_rows_compare_every_format_with_fp32_ar_and_hf():
    rows = combine({"none": summary({"ar": 30.0, "hf": 25.0}), "int4": summary({"ar": 45.0, "sd": 60.0})})
    by = {(r["format"], r["method"]): r for r in rows}
    assert by["none", "ar"]["x_fp32_ar"] == 1.0 and by["none", "ar"]["x_fp32_hf"] == 1.2
    assert by["int4", "ar"]["x_fp32_ar"] == 1.5 and by["int4", "sd"]["x_fp32_hf"] == 2.4
    assert by["int4", "sd"]["peak_mib"] == 1024
    alone = combine({"int4": summary({"ar": 45.0})})  # no fp32 run: no ratio is made up
    assert alone[0]["x_fp32_ar"] is None and alone[0]["x_fp32_hf"] is None


def test_each_format_runs_once_in_its_own_process_and_resumes(tmp_path):
    calls = []

    def fake_run(cmd, input, **kwargs):
        request = json.loads(input)
        calls.append((cmd, request))
        fmt = request["options"]["quant"]
        folder = Path(request["out"])
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(summary({"ar": {"none": 30.0, "int8": 40.0}[fmt]})))
        return type("P", (), {"returncode": 0, "stderr": ""})()

    opts = ModelOptions(model="./target", draft="ngram", quant="none,int8", max_context=64, compile="off")
    config = BenchConfig(methods=["ar"], max_new_tokens=6, repeats=2)
    prompts = PromptSource(None, limit=1)
    combined = run_formats(opts, config, prompts, ["none", "int8"], tmp_path, log=lambda m: None, run=fake_run)
    assert [request["options"]["quant"] for _, request in calls] == ["none", "int8"]
    # the process of a format gets the option values themselves, --quant set to the format
    assert calls[0] == ([sys.executable, "-m", "viasd_core.bench.formats"], {
        "options": {**dataclasses.asdict(opts), "quant": "none"}, "config": dataclasses.asdict(config),
        "prompts": {"path": None, "limit": 1, "categories": None}, "out": str(tmp_path / "none"), "command": sys.argv})
    written = json.loads((tmp_path / "formats.json").read_text())
    assert written["rows"] == combined["rows"] and combined["rows"][1]["x_fp32_ar"] == pytest.approx(40 / 30)
    calls.clear()
    run_formats(opts, config, prompts, ["none", "int8"], tmp_path, log=lambda m: None, run=fake_run)
    assert calls == []  # both summaries exist: read, not run again


def test_a_format_process_runs_the_bench_of_the_values_it_is_given(tmp_path, monkeypatch):
    import viasd_core.bench.formats as formats

    opts = ModelOptions(model="./target", draft="./draft", quant="none,int4", dtype="float32", profile="p.json",
                        max_context=96, compile="off", trust_remote_code=True)
    config = BenchConfig(methods=["ar", "sd"], max_new_tokens=7, gamma=3, adaptive=False, min_confidence=0.2, warmup=0,
                         repeats=2, seed=5, raw=True, viasd_profiles=["a.json", "b.json"])
    prompts = PromptSource("spec.jsonl", limit=3, categories="coding,math")
    request = json.loads(json.dumps(format_request(opts, config, prompts, "int4", tmp_path)))  # through its stdin
    seen = []
    monkeypatch.setattr(formats, "measure", lambda *args, **kwargs: seen.append((args, kwargs)) or {})
    run_format(request)
    assert seen == [((dataclasses.replace(opts, quant="int4"), config, prompts),
                     {"out": str(tmp_path / "int4"), "command": sys.argv})]


def test_bad_values_fail_once_before_any_format_process(tmp_path, monkeypatch, capsys):
    def never(cmd, **kwargs):
        raise AssertionError("no process may start")

    opts = ModelOptions(quant="none,int8")
    with pytest.raises(UsageError, match="--repeats must be at least 1"):
        run_formats(opts, BenchConfig(repeats=0), PromptSource(), ["none", "int8"], tmp_path, log=lambda m: None, run=never)
    with pytest.raises(UsageError, match="--limit must be at least 1"):
        run_formats(opts, BenchConfig(), PromptSource(limit=0), ["none", "int8"], tmp_path, log=lambda m: None, run=never)
    with pytest.raises(UsageError, match="needs --out DIR"):
        run_formats(opts, BenchConfig(), PromptSource(), ["none", "int8"], None, log=lambda m: None, run=never)
    # a format's process reports its error as one line and the exit code
    request = format_request(opts, BenchConfig(), PromptSource(limit=0), "int8", tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(request)))
    assert main() == 2
    assert capsys.readouterr().err == "Error: --limit must be at least 1 (got 0)\n"


def test_a_failed_format_is_a_one_line_error(tmp_path):
    def failing(cmd, **kwargs):
        return type("P", (), {"returncode": 1, "stderr": "loading...\nError: --quant int8 needs torchao\n"})()

    with pytest.raises(ViasdError, match="bench --quant int8 failed: Error: --quant int8 needs torchao"):
        run_formats(ModelOptions(), BenchConfig(), PromptSource(), ["int8"], tmp_path, log=lambda m: None, run=failing)


def test_cli_runs_formats_end_to_end(tiny_dirs, viasd_home, tmp_path):
    out = tmp_path / "formats"
    args = ["bench", "-m", str(tiny_dirs["target"]), "--device", "cpu", "--draft", "ngram", "--methods", "ar,sd",
            "--limit", "1", "-n", "6", "--quant", "none,int8", "--out", str(out), "--json"]
    r = CliRunner().invoke(get_app(), args)
    assert r.exit_code == 0, r.output
    combined = json.loads(r.stdout)
    assert [(row["format"], row["method"]) for row in combined["rows"]] == [("none", "ar"), ("none", "sd"), ("int8", "ar"), ("int8", "sd")]
    assert combined["rows"][0]["x_fp32_ar"] == 1.0
    assert combined["formats"]["int8"]["meta"]["quant"] == "int8" and combined["formats"]["none"]["meta"]["quant"] == "none"
    assert combined["formats"]["int8"]["meta"]["n_prompts"] == 1  # the other options reached each process
    # the way the int8 short passes multiplied (the suite pins it: machine/packed_way.py); float32 has none
    from viasd_core.runtime import cpu_kernels

    assert combined["formats"]["int8"]["meta"]["packed_way"] == cpu_kernels.packed_mm_way()
    assert combined["formats"]["none"]["meta"]["packed_way"] is None
    assert (out / "int8" / "results.jsonl").is_file() and (out / "formats.json").is_file()


def test_cli_needs_an_out_folder_for_several_formats(tiny_dirs, viasd_home):
    r = CliRunner().invoke(get_app(), ["bench", "-m", str(tiny_dirs["target"]), "--quant", "none,int4"])
    assert r.exit_code == 2 and "needs --out DIR" in r.output and "Traceback" not in r.output


def test_cli_synthetic_takes_a_single_format(viasd_home):
    r = CliRunner().invoke(get_app(), ["bench", "--synthetic", "tiny", "--quant", "none,int4", "--out", "x"])
    assert r.exit_code == 2 and "--synthetic projects one shape on random weights" in r.stderr
    assert "Traceback" not in r.output
