"""Nothing lost: every path a command writes at its end (bench --out, calibrate's profile, distill's
--out and --work, chat's /save) is checked before any work starts (paths.check_writable_*: one
line, exit 2, nothing loaded, nothing left behind), and a write that fails at the end anyway puts
the result in a fallback folder the error names (paths.write_elsewhere)."""

import errno
import json
import os

import pytest
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core import paths
from viasd_core.errors import UsageError

APP = get_app()  # every command imported now, before a test replaces what they import (no_work)
PROMPTS = ["w1 w2 w3 w4 w1 w2", "w9 w8 w7 w9 w8", "w5 w6 w7", "w8 w9 w10 w11"]


def invoke(*args, input=None):
    return CliRunner().invoke(APP, [str(a) for a in args], input=input)


def one_line_usage_error(r, message):
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "category": "c"}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def blocker(tmp_path):
    """A regular file: no folder can be made under it (root included)."""
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command starts its work: loads a model or reads its prompts."""
    from viasd_core import session
    from viasd_core.bench import measure
    from viasd_core.loading import synthetic
    from viasd_core.training import distill, feature_distill

    def started(*args, **kwargs):
        raise AssertionError("the work started before the output path was checked")

    for module, name in ((session, "build_session"), (measure, "build_session"), (distill, "load_model"),
                         (feature_distill, "load_model"), (synthetic, "run_synthetic")):
        monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(measure.PromptSource, "load", started)


def fail_once(monkeypatch, module, name, error=errno.ENOSPC, at=0):
    """Make module.name raise OSError(error) on its first call only; returns the calls' `at`-th arguments."""
    real, calls = getattr(module, name), []

    def writer(*args, **kwargs):
        calls.append(args[at])
        if len(calls) == 1:
            raise OSError(error, os.strerror(error))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, writer)
    return calls


# ---------------------------------------------------------------------- the one check
def test_the_checks_refuse_what_root_cannot_write_either_and_leave_nothing(tmp_path, blocker):
    before = listing(tmp_path)
    bad = [
        (paths.check_writable_dir, "/proc/viasd-out", "cannot write under '/proc'"),
        (paths.check_writable_dir, blocker / "run", "(a file, not a folder)"),
        (paths.check_writable_dir, blocker, "is a file: give a folder"),
        (paths.check_writable_file, "/proc/viasd-out/profile.json", "cannot write under '/proc'"),
        (paths.check_writable_file, blocker / "x" / "profile.json", f"cannot write under '{blocker}'"),
        (paths.check_writable_file, tmp_path, "is a folder: give the path of the file to write"),
        (paths.check_replaceable_dir, "/proc/viasd-draft", "cannot write under '/proc'"),
        (paths.check_replaceable_dir, blocker, "is a file: give a folder"),
    ]
    for check, path, message in bad:
        with pytest.raises(UsageError) as e:
            check(path, "--out")
        assert message in e.value.message and "\n" not in e.value.message and e.value.exit_code == 2
    # good paths: accepted, and no folder is created for the check, no probe file left
    assert paths.check_writable_dir(tmp_path / "new" / "run", "--out") == tmp_path / "new" / "run"
    assert paths.check_writable_file(tmp_path / "new" / "p.json", "--out") == tmp_path / "new" / "p.json"
    assert paths.check_replaceable_dir(tmp_path, "--out") == tmp_path  # an existing folder is replaced
    assert listing(tmp_path) == before


# ---------------------------------------------------------------------- bench
@pytest.mark.parametrize("out, message", [
    ("/proc/viasd-out", "--out '/proc/viasd-out': cannot write under '/proc'"),
    ("{blocker}/run", "cannot write under '{blocker}' (a file, not a folder)"),
    ("{blocker}", "--out '{blocker}' is a file: give a folder"),
    ("{tmp}/run", "--out '{tmp}/run/{file}' is a folder"),  # a folder where bench writes a file
])
@pytest.mark.parametrize("extra", [(), ("--synthetic", "tiny"), ("--quant", "none,int8")], ids=["run", "synthetic", "formats"])
def test_bench_refuses_a_bad_out_before_any_work(tiny_dirs, viasd_home, prompt_file, tmp_path, blocker, no_work, out,
                                                 message, extra):
    for file in ("summary.json", "formats.json"):
        (tmp_path / "run" / file).mkdir(parents=True)
    file = "formats.json" if "--quant" in extra else "summary.json"
    out, message = (s.format(blocker=blocker, tmp=tmp_path, file=file) for s in (out, message))
    before = listing(tmp_path)
    r = invoke("bench", "-m", tiny_dirs["target"], "--methods", "ar", "--prompts", prompt_file, "-n", "4",
               "--device", "cpu", "--out", out, *extra)
    one_line_usage_error(r, message)
    assert listing(tmp_path) == before and not (viasd_home / "cache" / "unsaved").exists()


def test_bench_whose_last_write_fails_keeps_its_measurements(tiny_dirs, viasd_home, prompt_file, tmp_path,
                                                             monkeypatch):
    from viasd_core.bench import files

    calls = fail_once(monkeypatch, files, "atomic_write_text")
    out = tmp_path / "run"
    r = invoke("bench", "-m", tiny_dirs["target"], "--methods", "ar", "--prompts", prompt_file, "--limit", "2",
               "-n", "4", "--device", "cpu", "--out", out)
    assert r.exit_code == 1, r.stderr
    assert "tok/s" in r.stdout  # the table, as ever
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: could not write to --out '{out}' (No space left on device): this run's files are in '")
    kept = viasd_home / "cache" / "unsaved"
    (folder,) = kept.iterdir()
    assert folder.name.startswith("bench-") and f"'{folder}' instead" in last
    assert calls[0] == out / "results.jsonl" and calls[1] == folder / "results.jsonl"
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["status"], r["prompt_id"]) for r in rows] == [("ar", "ok", "1"), ("ar", "ok", "2")]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["methods"]["ar"]["status"] == "ok" and summary["meta"]["n_prompts"] == 2
    assert {p.name for p in folder.iterdir()} == set(files.RUN_FILES)


def test_bench_written_nowhere_prints_its_summary(tiny_dirs, viasd_home, prompt_file, tmp_path, monkeypatch):
    from viasd_core.bench import files

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "atomic_write_text", full)
    monkeypatch.chdir(tmp_path)
    r = invoke("bench", "-m", tiny_dirs["target"], "--methods", "ar", "--prompts", prompt_file, "--limit", "1",
               "-n", "4", "--device", "cpu", "--out", tmp_path / "run", "--json")
    assert r.exit_code == 1
    assert "nor to the cache or the current folder: the summary JSON is on stdout" in r.stderr.strip().splitlines()[-1]
    assert json.loads(r.stdout)["methods"]["ar"]["status"] == "ok"
    assert list((viasd_home / "cache" / "unsaved").iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("viasd-unsaved")]


# ---------------------------------------------------------------------- calibrate
@pytest.mark.parametrize("profile, message", [
    ("/proc/viasd/profile.json", "--profile '/proc/viasd/profile.json': cannot write under '/proc'"),
    ("{blocker}/profile.json", "cannot write under '{blocker}' (a file, not a folder)"),
    ("{tmp}", "--profile '{tmp}' is a folder: give the path of the profile file to write"),
    (None, "the profiles folder '{home}/config/profiles': cannot write under '{home}/config' (a file, not a folder)"),
])
def test_calibrate_refuses_a_bad_profile_path_before_any_work(tiny_dirs, viasd_home, prompt_file, tmp_path, blocker,
                                                              no_work, profile, message):
    viasd_home.mkdir()
    (viasd_home / "config").write_text("not a folder")  # the default profiles folder cannot be made
    message = message.format(blocker=blocker, tmp=tmp_path, home=viasd_home)
    extra = ("--profile", profile.format(blocker=blocker, tmp=tmp_path)) if profile else ()
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", prompt_file, "-n", "4",
               *extra)
    one_line_usage_error(r, message)


def test_calibrate_whose_profile_write_fails_keeps_the_profile(tiny_dirs, viasd_home, prompt_file, tmp_path,
                                                               monkeypatch):
    out = tmp_path / "profiles" / "pair.json"
    from viasd_core.loading import profile

    calls = fail_once(monkeypatch, profile, "save_profile", errno.ENOENT, at=1)
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["target"], "--prompts", prompt_file,
               "--limit", "2", "-n", "4", "--budget", "0.05", "--force", "--profile", out, "--json")
    assert r.exit_code == 1, r.stderr
    (folder,) = (viasd_home / "cache" / "unsaved").iterdir()
    kept = folder / "pair.json"
    assert calls == [out, kept]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"Error: could not write the profile to '{out}' (No such file or directory): it is in '{kept}' "
                    f"instead: move it to '{out}' or pass --profile '{kept}'")
    assert json.loads(kept.read_text()) == json.loads(r.stdout) and json.loads(r.stdout)["n_layers"] == 4


# ---------------------------------------------------------------------- distill
@pytest.mark.parametrize("args, message", [
    (("--out", "/proc/viasd-draft"), "--out '/proc/viasd-draft': cannot write under '/proc'"),
    (("--out", "{blocker}/draft"), "cannot write under '{blocker}' (a file, not a folder)"),
    (("--out", "{blocker}"), "--out '{blocker}' is a file: give a folder"),
    (("--kind", "feature", "--work", "{tmp}/w", "--out", "/proc/viasd-head"), "--out '/proc/viasd-head': cannot write"),
    (("--kind", "feature", "--out", "{tmp}/h", "--work", "/proc/viasd-work"), "--work '/proc/viasd-work': cannot write"),
    (("--kind", "feature", "--out", "{tmp}/h", "--work", "{blocker}"), "--work '{blocker}' is a file: give a folder"),
])
def test_distill_refuses_a_bad_out_or_work_before_any_work(tiny_dirs, viasd_home, prompt_file, tmp_path, blocker,
                                                           no_work, args, message):
    before = listing(tmp_path)
    r = invoke("distill", "--target", tiny_dirs["target"], "--prompts", prompt_file,
               *(a.format(blocker=blocker, tmp=tmp_path) for a in args))
    one_line_usage_error(r, message.format(blocker=blocker, tmp=tmp_path))
    assert listing(tmp_path) == before  # --work is not created for a refused run


def test_distill_whose_save_fails_keeps_the_draft(tiny_dirs, viasd_home, prompt_file, tmp_path, monkeypatch):
    from viasd_core.loading.draft_model import read_draft_config
    from viasd_core.training import distill

    calls = fail_once(monkeypatch, distill, "save_draft")
    out = tmp_path / "draft"
    r = invoke("distill", "--target", tiny_dirs["target"], "--out", out, "--prompts", prompt_file, "--layers", "1",
               "--draft-vocab", "16", "--steps", "2", "--batch-size", "2", "--max-new-tokens", "4", "--fp32",
               "--device", "cpu")
    assert r.exit_code == 1, r.stderr
    (folder,) = (viasd_home / "cache" / "unsaved").iterdir()
    kept = folder / "draft"
    assert folder.name.startswith("distill-") and calls == [out, kept]
    assert r.stderr.strip().splitlines()[-1] == (f"Error: could not write --out '{out}' (No space left on device): "
                                                 f"the draft is in '{kept}' instead")
    assert read_draft_config(kept)["training"]["steps"] == 2 and not out.exists()


# ---------------------------------------------------------------------- chat
def test_chat_save_refuses_a_folder_in_one_line_and_the_chat_goes_on(tiny_dirs, viasd_home, tmp_path):
    script = f"w1 w2\n/save {tmp_path}\n/save /proc/viasd/chat.json\n/save {tmp_path}/chat.json\n"
    r = invoke("chat", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "-n", "4", input=script)
    assert r.exit_code == 0, r.stderr
    assert f"/save '{tmp_path}' is a folder: give the path of the transcript file to write" in r.stderr
    assert "/save '/proc/viasd/chat.json': cannot write under '/proc'" in r.stderr
    assert f"saved 1 turns to {tmp_path}/chat.json" in r.stderr
    assert json.loads((tmp_path / "chat.json").read_text())["version"] == 1
