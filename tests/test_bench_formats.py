"""`viasd bench --quant A,B --out DIR`: one bench process per format, combined against fp32."""

import json
import sys

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.bench.formats import combine, run_formats, split_formats
from viasd_core.errors import UsageError, ViasdError


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

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        fmt = cmd[cmd.index("--quant") + 1]
        folder = tmp_path / fmt
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(summary({"ar": {"none": 30.0, "int8": 40.0}[fmt]})))
        return type("P", (), {"returncode": 0, "stderr": ""})()

    combined = run_formats(["--methods", "ar"], ["none", "int8"], tmp_path, log=lambda m: None, run=fake_run)
    assert [c[c.index("--quant") + 1] for c in calls] == ["none", "int8"]
    assert calls[0] == [sys.executable, "-m", "viasd_cli", "bench", "--methods", "ar", "--quant", "none",
                        "--out", str(tmp_path / "none"), "--json", "--quiet"]
    written = json.loads((tmp_path / "formats.json").read_text())
    assert written["rows"] == combined["rows"] and combined["rows"][1]["x_fp32_ar"] == pytest.approx(40 / 30)
    calls.clear()
    run_formats(["--methods", "ar"], ["none", "int8"], tmp_path, log=lambda m: None, run=fake_run)
    assert calls == []  # both summaries exist: read, not run again


def test_a_failed_format_is_a_one_line_error(tmp_path):
    def failing(cmd, **kwargs):
        return type("P", (), {"returncode": 1, "stderr": "loading...\nError: --quant int8 needs torchao\n"})()

    with pytest.raises(ViasdError, match="bench --quant int8 failed: Error: --quant int8 needs torchao"):
        run_formats([], ["int8"], tmp_path, log=lambda m: None, run=failing)


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
    assert (out / "int8" / "results.jsonl").is_file() and (out / "formats.json").is_file()


def test_cli_needs_an_out_folder_for_several_formats(tiny_dirs, viasd_home):
    r = CliRunner().invoke(get_app(), ["bench", "-m", str(tiny_dirs["target"]), "--quant", "none,int4"])
    assert r.exit_code == 2 and "needs --out DIR" in r.output and "Traceback" not in r.output
