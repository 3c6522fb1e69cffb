"""`viasd calibrate` takes the shared model options: --max-context, --compile and --profile (the file
the profile is written to) reach the calibration; bad values are one line and exit 2."""

import json
import os
from pathlib import Path

import pytest

from support.cli_cases import invoke, prompt_file  # noqa: F401 (prompt_file: a fixture)
from viasd_core import paths
from viasd_core import session as session_module

PROMPT_TOKENS = 9  # "<user> w.. x6 </s> <assistant> " under the tiny chat template


@pytest.fixture
def spied(monkeypatch):
    """The sessions calibration builds, the --compile choices applied, and every rename of a written file."""
    seen = {"sessions": [], "compile": [], "renames": []}
    build, apply, replace = session_module.build_session, session_module.apply_compile, os.replace

    def build_session(*args, **kwargs):
        seen["sessions"].append(build(*args, **kwargs))
        return seen["sessions"][-1]

    def apply_compile(engine, choice, *args, **kwargs):
        seen["compile"].append(choice)
        return apply(engine, choice, *args, **kwargs)

    def rename(src, dst):
        seen["renames"].append((Path(src), Path(dst)))
        return replace(src, dst)

    monkeypatch.setattr(session_module, "build_session", build_session)
    monkeypatch.setattr(session_module, "apply_compile", apply_compile)
    monkeypatch.setattr(paths.os, "replace", rename)
    return seen


def test_calibrate_honours_max_context_compile_and_profile(tiny_dirs, viasd_home, prompt_file, tmp_path, spied):
    out = tmp_path / "profiles" / "pair.json"  # its folder does not exist yet
    context = 20
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["target"], "--prompts", prompt_file, "--limit", "4",
               "-n", "16", "--skip-ratio", "0.5", "--budget", "0.05", "--max-context", context, "--compile", "off",
               "--profile", out, "--json")
    assert r.exit_code == 0, r.stderr
    # --max-context: every cache of the session holds exactly that many positions, also after the
    # pass costs were measured and the slim views attached (nothing grew past it)
    (session,) = spied["sessions"]
    engine = session.engine
    assert session.options.max_context == engine.context_len == context
    assert engine.target.max_len == engine.slim.max_len == engine.drafter.model.max_len == context
    measured = json.loads(r.stdout)["measured"]
    assert 0 < measured["viasd"]["new_tokens"] <= measured["n_heldout_prompts"] * (context - PROMPT_TOKENS) < 2 * 16
    # --compile off: the choice reached the session, nothing compiled
    assert spied["compile"] == ["off"] and session.compile_seconds is None and not engine.compiled
    # --profile PATH: the profile is written there (through a temporary file in the same folder,
    # then a rename), and nowhere else
    assert json.loads(out.read_text()) == json.loads(r.stdout)
    (tmp, dst), = [(s, d) for s, d in spied["renames"] if d == out]
    assert tmp.parent == out.parent and tmp.name.startswith(".pair.json.") and not tmp.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["pair.json"]
    assert f"profilesavedto{out}" in "".join(r.stderr.split())  # rich wraps the line at the console width
    assert not (viasd_home / "config" / "profiles").exists()


def test_calibrate_out_is_the_profile_option(tiny_dirs, viasd_home, prompt_file, tmp_path):
    out = tmp_path / "old-spelling.json"
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["target"], "--prompts", prompt_file, "--limit", "2",
               "-n", "4", "--budget", "0.05", "--out", out, "--force")
    assert r.exit_code == 0, r.stderr
    assert json.loads(out.read_text())["n_layers"] == 4
    assert not (viasd_home / "config" / "profiles").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-context", "8"], "--max-context must be at least 16, got 8"),
        (["--max-context", "100000"], "--max-context 100000 exceeds the model's context (512 positions)"),
        (["--compile", "sometimes"], "unknown --compile 'sometimes': use auto, on or off"),
        (["--profile", "{tmp}"], "is a folder: give the path of the profile file to write"),
        (["--profile", "{tmp}/a-file/profile.json"], "cannot write under"),
    ],
)
def test_calibrate_bad_model_options_are_one_line(tiny_dirs, viasd_home, prompt_file, tmp_path, extra, message):
    (tmp_path / "a-file").write_text("not a folder")
    extra = [e.format(tmp=tmp_path) for e in extra]
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", prompt_file, "-n", "4", *extra)
    assert r.exit_code == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0] and r.stderr.strip().endswith(errors[0])
    assert "Traceback" not in r.stderr
    assert not (viasd_home / "config" / "profiles").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == []
