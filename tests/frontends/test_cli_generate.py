"""`viasd generate` through the real Typer app: arguments, stdin, JSON schema, exit codes, stdout purity."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.errors import ViasdError

PROMPT = "w1 w2 w3 w4 w5 w6"


def run(*args, input=None):
    return CliRunner().invoke(get_app(), ["generate", *map(str, args)], input=input)


def test_text_to_stdout_stats_to_stderr(tiny_dirs, viasd_home):
    r = run(PROMPT, "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "-n", "12")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() and all(w.startswith("w") or w.startswith("<") for w in r.stdout.split())
    assert "[sd] " in r.stderr and "tokens/target pass" in r.stderr
    assert "[sd]" not in r.stdout and "tok/s" not in r.stdout
    quiet = run(PROMPT, "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "-n", "12", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == r.stdout


def test_json_schema_and_sd_equals_ar(tiny_dirs, viasd_home):
    outs = {}
    for mode in ("ar", "sd"):
        r = run(PROMPT, "w9 w8", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "-n", "16", "--mode", mode, "--json", "-q")
        assert r.exit_code == 0, r.stderr
        rows = [json.loads(line) for line in r.stdout.splitlines()]
        assert len(rows) == 2
        for i, row in enumerate(rows):
            assert row["index"] == i and row["mode"] == mode
            assert set(row) >= {"prompt", "text", "prompt_tokens", "new_tokens", "finish_reason", "stats", "draft", "model", "fidelity"}
            assert row["new_tokens"] == row["stats"]["new_tokens"] and 1 <= row["new_tokens"] <= 16
            assert row["finish_reason"] in ("eos", "length")
            s = row["stats"]
            assert s["target_passes"] >= 1 and s["tokens_per_s"] > 0
            assert set(s["tier_shares"]) == {"accept", "slim", "full", "bonus"}
        outs[mode] = [row["text"] for row in rows]
    assert outs["sd"] == outs["ar"]


def test_stdin_whole_and_lines(tiny_dirs, viasd_home):
    r = run("-m", tiny_dirs["target"], "-d", "ngram", "-n", "8", "--json", "-q", input="w1 w2\nw3 w4\n")
    assert r.exit_code == 0, r.stderr
    assert [json.loads(x)["prompt"] for x in r.stdout.splitlines()] == ["w1 w2\nw3 w4"]
    r = run("-m", tiny_dirs["target"], "-d", "ngram", "-n", "8", "--json", "-q", "--lines", input="w1 w2\n\nw3 w4\n")
    assert [json.loads(x)["prompt"] for x in r.stdout.splitlines()] == ["w1 w2", "w3 w4"]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["-t", "-1"], 2, "temperature must be >= 0"),
        (["--top-p", "0"], 2, "top-p must be in (0, 1]"),
        (["--top-p", "1.5"], 2, "top-p must be in (0, 1]"),
        (["--gamma", "0"], 2, "gamma must be at least 1"),
        (["--mode", "fast"], 2, "unknown mode 'fast'"),
    ],
)
def test_bad_options_one_line_errors(tiny_dirs, viasd_home, args, code, message):
    r = run(PROMPT, "-m", tiny_dirs["target"], *args)
    assert r.exit_code == code
    assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_bad_models_and_prompts(tiny_dirs, viasd_home, tmp_path):
    def check(r, code, message):
        assert r.exit_code == code, (r.exit_code, r.stderr)
        assert message in r.stderr, r.stderr
        assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert r.stdout == ""

    check(run(PROMPT, "-m", tmp_path / "missing"), 1, "not found")
    # a hub id not in the cache is downloaded on first use; offline (HF_HUB_OFFLINE=1 here), one line naming it
    check(run(PROMPT, "-m", "no-such-org/no-such-model"), 1, "cannot pull no-such-org/no-such-model: offline mode is on")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_dirs["target"] / "config.json").read_text())
    check(run(PROMPT, "-m", empty), 1, "has no weights")
    pickle_only = tmp_path / "pickle"
    shutil.copytree(tiny_dirs["target"], pickle_only)
    (pickle_only / "model.safetensors").rename(pickle_only / "pytorch_model.bin")
    check(run(PROMPT, "-m", pickle_only), 1, "--allow-pickle")
    # one vocabulary check (shared with `viasd pull`): it names both models and a differing token
    check(run(PROMPT, "-m", tiny_dirs["target"], "-d", tiny_dirs["other"]), 1,
          f"target {tiny_dirs['target']} and draft {tiny_dirs['other']} use different tokenizers (256 vs 256 tokens, 496 differ, e.g. 'w0': id 8 vs None)")
    # one hub-id rule (shared with `viasd pull`): a malformed id is no id, so the model is not found
    check(run(PROMPT, "-m", "org/name with spaces"), 1, "model 'org/name with spaces' not found")
    check(run("   ", "-m", tiny_dirs["target"]), 2, "prompt is empty")
    long_prompt = " ".join(["w1"] * 600)  # the tiny models have 512 positions
    # errors found once the model is loaded (a set thread count: a busy machine's auto choice is said first)
    check(run(long_prompt, "-m", tiny_dirs["target"], "--threads", "1"), 1, "shorten the prompt")
    check(run(PROMPT, "-m", tiny_dirs["target"], "--mode", "viasd", "--threads", "1"), 1, "run `viasd calibrate")
    check(run(PROMPT, "-m", tiny_dirs["target"], "--dtype", "int3"), 2, "unknown dtype")


class ScriptedTokenizer:
    """decode() returns a scripted text per prefix length: lets a test shrink the text or leave a
    multi-byte character half-decoded, as real tokenizers do."""

    def __init__(self, texts):
        self.texts = texts

    def decode(self, ids, skip_special_tokens=True):
        return self.texts[len(ids) - 1]


def test_text_stream_releases_only_settled_text():
    import io

    from viasd_core.frontends.streaming import TextStream

    out = io.StringIO()
    stream = TextStream(ScriptedTokenizer(["ab", "a", "abc\ufffd", "abcé", "abcé!"]), out)
    stream([1], ["full"])
    stream([2], ["accept"])  # the text shrank: nothing is taken back, nothing printed twice
    assert out.getvalue() == "ab"
    stream([3], ["accept"])  # a half-decoded character is held back
    assert out.getvalue() == "ab"
    stream([4, 5], ["slim", "bonus"])
    assert out.getvalue() == "abcé!"
    stream.finish("abcé! the end")
    assert out.getvalue() == "abcé! the end\n"


def test_main_reports_any_error_in_one_line(tiny_dirs, viasd_home, monkeypatch, capsys):
    import sys

    import viasd_cli.app as cli_app
    import viasd_cli.generate

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(viasd_cli.generate, "open_session", broken)
    monkeypatch.setattr(sys, "argv", ["viasd", "generate", PROMPT, "-m", str(tiny_dirs["target"])])
    monkeypatch.delenv("VIASD_DEBUG", raising=False)
    with pytest.raises(SystemExit) as info:
        cli_app.main()
    assert info.value.code == 1
    assert capsys.readouterr().err == "Error: RuntimeError: boom (set VIASD_DEBUG=1 for the traceback)\n"
    monkeypatch.setattr(sys, "argv", ["viasd", "generate", PROMPT, "--gamma", "0"])
    with pytest.raises(SystemExit) as info:  # a ViasdError raised before any model is loaded
        cli_app.main()
    assert info.value.code == 2 and capsys.readouterr().err == "Error: gamma must be at least 1 (got 0): pass --gamma 1 or more\n"
    monkeypatch.setenv("VIASD_DEBUG", "1")  # the same rule for both: the traceback instead of the line
    monkeypatch.setattr(sys, "argv", ["viasd", "generate", PROMPT, "-m", str(tiny_dirs["target"])])
    with pytest.raises(RuntimeError, match="boom"):
        cli_app.main()
    monkeypatch.setattr(sys, "argv", ["viasd", "generate", PROMPT, "--gamma", "0"])
    with pytest.raises(ViasdError, match="gamma must be at least 1"):
        cli_app.main()
