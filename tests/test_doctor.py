"""`viasd doctor`: its checks pass on a sound engine and fail, with exit code 1, on a broken one."""

import json

import torch
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.frontends.doctor import FAIL, PASS, SKIP, run_doctor
from viasd_core.session import build_session
from viasd_core.loading.options import ModelOptions


def doctor(*args):
    return CliRunner().invoke(get_app(), ["doctor", *map(str, args)])


class CorruptingDrafter:
    """A drafter that overwrites the last committed token in the engine's buffer: the target then
    reads a context that is not the text. `sd` can no longer equal `ar`, and doctor must say so."""

    def __init__(self, inner):
        self.inner = inner
        self.model = inner.model

    def propose(self, ids, n, gamma, params, sampler, host_tokens=None, **options):
        proposal = self.inner.propose(ids, n, gamma, params, sampler, host_tokens, **options)
        ids[n - 1] = (ids[n - 1] + 7) % 200 + 8
        return proposal

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_doctor_reports_and_passes_on_a_sound_engine(tiny_dirs, viasd_home):
    r = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", 2, "-n", 12, "--json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is True
    env = report["environment"]
    assert env["device"] == "cpu" and env["dtype"] == "float32" and env["compiled"] is False
    assert env["cuda_graphs"] is False and env["torch"] == torch.__version__
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"compiled == eager": SKIP, "sd == ar (greedy)": PASS, "exact == ar (greedy)": PASS}
    assert report["speed"]["ar"]["tokens_per_s"] > 0 and report["speed"]["sd"]["tokens_per_target_pass"] >= 1
    table = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", 1, "-n", 8, "--no-speed")
    assert table.exit_code == 0 and "sd == ar (greedy)" in table.stdout and "pass" in table.stdout


def test_doctor_compares_the_compiled_pass_with_eager(tiny_dirs, viasd_home):
    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]),
                                         compile="on", max_context=128), mode="sd")
    assert session.engine.compiled and session.compile_seconds > 0
    report = run_doctor(session, [[8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]], max_new_tokens=10, speed=False)
    checks = {c.name: c for c in report.checks}
    assert checks["compiled == eager"].status == PASS, checks["compiled == eager"].detail
    assert report.environment["compiled"] is True and report.ok


def test_doctor_fails_on_a_broken_drafter(tiny_dirs, viasd_home, monkeypatch):
    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])), mode="sd")
    session.engine.drafter = CorruptingDrafter(session.engine.drafter)
    report = run_doctor(session, [[8, 9, 10, 11, 12, 13]], max_new_tokens=16, speed=False)
    checks = {c.name: c for c in report.checks}
    assert checks["sd == ar (greedy)"].status == FAIL and "differs from ar" in checks["sd == ar (greedy)"].detail
    assert not report.ok

    import viasd_cli.doctor as cli_doctor

    def broken_session(opts, **kwargs):
        s = build_session(opts, **kwargs)
        s.engine.drafter = CorruptingDrafter(s.engine.drafter)
        return s

    monkeypatch.setattr(cli_doctor, "build_session", broken_session)
    r = doctor("-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", 1, "-n", 16, "--no-speed", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["ok"] is False


def test_doctor_bad_option_is_one_line(tiny_dirs, viasd_home):
    r = doctor("-m", tiny_dirs["target"], "--prompts", 0)
    assert r.exit_code == 2 and r.stdout == ""
    assert "--prompts and --max-new-tokens must be at least 1" in r.stderr and r.stderr.count("\n") == 1
