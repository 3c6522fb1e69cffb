"""One assembly: every front end's GenerationConfig comes from session.resolve_config, which puts the
session's measured decisions (the profile's thresholds, sd's draft trees, sd's first block) into a
new config and changes nothing it was given.

--tree auto's probe is replaced by a stated TreeChoice (machine/tree.resolve_tree, as session.py
calls it): what is checked is where its answer goes, not the measurement.
"""

import dataclasses

import pytest

from support.cli_cases import prompt_file  # noqa: F401 (a fixture)
from viasd_core import session as session_module
from viasd_core.errors import UsageError
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.profile import Profile
from viasd_core.machine.tree import TreeChoice, shape_for_size
from viasd_core.session import GenerationRequest, build_session, resolve_config, thresholds_of
from viasd_core.speculation.draft_policy import FLOOR
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.speculation.router import Thresholds

# the probe's chains: 4 tokens a pass (3 drafts) measure fastest, so sd's first block is 3
CHAINS = [{"name": "chain of 3", "shape": None, "width": 4, "tau": 2.0, "draft_seconds": 0.001, "tokens_per_s": 9.0},
          {"name": "chain of 1", "shape": None, "width": 2, "tau": 1.5, "draft_seconds": 0.001, "tokens_per_s": 5.0}]
TREES = TreeChoice(shape_for_size(4), "stated: trees of 4", CHAINS, {})
NO_TREES = TreeChoice(None, "stated: chains", CHAINS, {})
PROFILE = Profile(target_id="target", draft_id="draft", quant="none", device="cpu", dtype="float32", layer_ids=[0, 2],
                  n_layers=4, theta_accept=0.9, theta_slim=0.3, budget=0.1, heldout_fidelity=1.0, theta_confidence=0.2)


@pytest.fixture
def probe(monkeypatch):
    """State what --tree auto resolves to (`probe.answer`); `probe.calls` counts the resolutions."""

    class Probe:
        answer = TREES
        calls = 0

    def resolve_tree(engine, prompts, choice, key, progress=None, refresh=False):
        Probe.calls += 1
        return Probe.answer

    monkeypatch.setattr(session_module, "resolve_tree", resolve_tree)
    return Probe


def options(tiny_dirs, **kw) -> ModelOptions:
    return ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), quant="none", compile="off",
                        threads="1", max_context=64, **kw)


@pytest.fixture
def session(tiny_dirs, viasd_home, probe):
    return build_session(options(tiny_dirs), mode="sd")


@pytest.fixture
def spy(monkeypatch):
    """Replace resolve_config where a module calls it with one that records (asked, kwargs, config)."""
    calls = []

    def recording(session, asked, progress=None, refresh=False):
        config = resolve_config(session, asked, progress, refresh)
        calls.append((asked, {"progress": progress, "refresh": refresh}, config))
        return config

    def install(*modules):
        for module in modules:
            monkeypatch.setattr(module, "resolve_config", recording)
        return calls

    return install


# ---------------------------------------------------------------------- the function
def test_the_config_holds_the_profile_thresholds_and_the_trees(session, probe):
    session.profile = PROFILE
    asked = GenerationRequest(mode="sd", max_new_tokens=7, stop=("END",), temperature=0.5, seed=3)
    config = resolve_config(session, asked)
    assert config.thresholds == thresholds_of(PROFILE) == Thresholds(0.9, 0.3, 0.2)
    assert config.tree == TREES.shape and session.tree is TREES
    assert (config.mode, config.max_new_tokens, config.stop, config.temperature, config.seed) == ("sd", 7, ("END",), 0.5, 3)
    # with trees, no first block: gamma stays GenerationConfig's, while the user gave none
    assert config.gamma == GenerationConfig.gamma and config.gamma_floor == FLOOR and config.auto_gamma
    assert session.first_block is None
    again = resolve_config(session, asked)
    assert again == config and again is not config  # a new config each call, equal for the same request
    assert probe.calls == 1  # --tree resolved once per session
    resolve_config(session, asked, refresh=True)
    assert probe.calls == 2  # doctor's refresh measures again


def test_chains_start_at_the_first_block_measured_here(session, probe):
    probe.answer = NO_TREES
    config = resolve_config(session, GenerationRequest(mode="sd"))
    assert config.tree is None and config.gamma == config.gamma_floor == 3
    assert session.first_block == (3, "the probe's fastest chain on this machine is 3 drafts")
    # trees declined: chains from the measured block even where the machine grows trees
    probe.answer = TREES
    chains = resolve_config(session, GenerationRequest(mode="sd", trees=False), refresh=True)
    assert chains.tree is None and chains.gamma == chains.gamma_floor == 3
    # a given gamma, or measured_start off, keeps GenerationConfig's block and floor
    given = resolve_config(session, GenerationRequest(mode="sd", gamma=6, trees=False))
    assert (given.gamma, given.gamma_floor, given.auto_gamma) == (6, FLOOR, False)
    plain = resolve_config(session, GenerationRequest(mode="sd", trees=False, measured_start=False))
    assert (plain.gamma, plain.gamma_floor) == (GenerationConfig.gamma, FLOOR)


def test_other_modes_take_no_machine_decision_and_own_thresholds_win(session, probe):
    session.profile = PROFILE
    ar = resolve_config(session, GenerationRequest(mode="ar"))
    assert ar.tree is None and ar.gamma == GenerationConfig.gamma and probe.calls == 0 and session.tree is None
    own = Thresholds(0.5, 0.2)
    viasd = resolve_config(session, GenerationRequest(mode="viasd", thresholds=own))
    assert viasd.thresholds is own


def test_nothing_given_is_changed(session, probe):
    session.profile = PROFILE
    asked = GenerationRequest(mode="sd", max_new_tokens=5)
    kept = dataclasses.replace(asked)
    resolve_config(session, asked)
    assert asked == kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.mode = "ar"  # a request is frozen: one serves several configs
    # a config resolved before: a copy with the session profile's thresholds, the rest kept
    before = GenerationConfig(mode="sd", max_new_tokens=5, gamma=3, tree=shape_for_size(4))
    snapshot = dataclasses.replace(before)
    after = resolve_config(session, before)
    assert before == snapshot and before.thresholds is None
    assert after == dataclasses.replace(snapshot, thresholds=thresholds_of(PROFILE)) and after is not before


def test_a_request_reads_the_parsed_options_back():
    parsed = GenerationConfig(mode="exact", max_new_tokens=9, auto_gamma=True, top_k=4, stop=("x",), min_confidence=0.1)
    assert GenerationRequest.of(parsed) == GenerationRequest(mode="exact", max_new_tokens=9, top_k=4, stop=("x",),
                                                             min_confidence=0.1)
    assert GenerationRequest.of(dataclasses.replace(parsed, gamma=7, auto_gamma=False)).gamma == 7


# ---------------------------------------------------------------------- the front ends
def test_the_cli_config_is_the_resolved_one(tiny_dirs, viasd_home, probe, spy):
    from viasd_cli import options as cli_options

    calls = spy(cli_options)
    config = GenerationConfig(mode="sd", max_new_tokens=9, auto_gamma=True, stop=("END",))
    parsed = dataclasses.replace(config)
    said = []
    session, got = cli_options.open_session(options(tiny_dirs), config, progress=said.append)
    ((asked, kw, resolved),) = calls
    assert asked == GenerationRequest.of(parsed) and kw["progress"] is not None
    assert got is resolved and got.tree == TREES.shape and session.tree is TREES
    assert config == parsed  # the parsed options are not rewritten
    assert "draft trees of 4 tokens (stated: trees of 4)" in said
    # validated after resolving: a bad value is one UsageError, before any generation
    bad = GenerationConfig(mode="sd", max_new_tokens=9, temperature=-1.0)
    with pytest.raises(UsageError, match="temperature"):
        cli_options.open_session(options(tiny_dirs), bad, progress=None)


def test_every_bench_method_of_our_engine_runs_a_resolved_config(session, probe, spy):
    from viasd_core.bench import harness
    from viasd_core.bench.harness import BenchConfig
    from viasd_core.bench.runners import EngineRunner

    calls = spy(harness)
    log = [].append
    bench = BenchConfig(methods=["ar", "sd", "sd-tree"], max_new_tokens=6, seed=4)
    runners = harness.make_runners(session, bench, progress=log)
    made = {id(config) for _, _, config in calls}
    assert all(isinstance(r, EngineRunner) and id(r.config) in made for r in runners.values())
    assert all(kw["progress"] is log for _, kw, _ in calls)
    sd, tree, ar = runners["sd"].config, runners["sd-tree"].config, runners["ar"].config
    assert sd.tree is None and sd.gamma == sd.gamma_floor == 3  # chains from the block measured here
    assert tree.tree == TREES.shape and tree.gamma == GenerationConfig.gamma  # trees from gamma's default
    assert ar.mode == "ar" and all(c.max_new_tokens == 6 and c.seed == 4 and c.temperature == 0 for c in (sd, tree, ar))
    assert probe.calls == 1


def test_bench_hands_its_log_to_the_runners(tiny_dirs, viasd_home, probe, monkeypatch, prompt_file):
    from viasd_core.bench import harness, measure
    from viasd_core.bench.harness import BenchConfig

    seen = []

    def make_runners(session, config, **kw):
        seen.append(kw)
        raise UsageError("stopped before running")

    monkeypatch.setattr(harness, "make_runners", make_runners)
    log = [].append
    with pytest.raises(UsageError, match="stopped"):
        measure.measure(options(tiny_dirs), BenchConfig(methods=["sd"]), measure.PromptSource(str(prompt_file)), log=log)
    assert seen == [{"progress": log}]


def test_doctor_probes_the_resolved_configs(session, probe, spy, monkeypatch):
    from viasd_core.frontends import doctor as core_doctor
    from viasd_core.frontends.doctor_checks import PASS, Check

    calls = spy(core_doctor)
    probe.answer = NO_TREES
    probed = {}
    monkeypatch.setattr(core_doctor, "environment", lambda session, refresh=False: {})
    monkeypatch.setattr(core_doctor, "check_compiled_matches_eager", lambda *a, **k: Check("c", PASS, ""))
    monkeypatch.setattr(core_doctor, "check_exact_mode", lambda *a, **k: Check("e", PASS, ""))
    monkeypatch.setattr(core_doctor, "format_curves", lambda session: None)
    monkeypatch.setattr(core_doctor, "speed_probe", lambda session, ids, configs: probed.update(configs) or {})
    report = core_doctor.run_doctor(session, [[8, 9, 10, 11]], max_new_tokens=5, speed=True)
    resolved = {config.mode: (asked, kw, config) for asked, kw, config in calls}
    assert set(probed) == {"ar", "sd"} and all(probed[m] is resolved[m][2] for m in probed)
    assert resolved["sd"][1]["refresh"] and not resolved["sd"][0].trees  # measured again; the probe's sd drafts chains
    assert probed["sd"].gamma == probed["sd"].gamma_floor == 3 and probed["sd"].max_new_tokens == 5
    assert report.tree == NO_TREES.to_dict() and report.first_block["gamma"] == 3


def test_the_server_serves_the_resolved_config(session, spy):
    from viasd_core.frontends import serve_server

    calls = spy(serve_server)
    session.profile = PROFILE
    config = GenerationConfig(mode="sd", max_new_tokens=5)
    kept = dataclasses.replace(config)
    served = serve_server.prepare(session, config)
    ((asked, _, resolved),) = calls
    assert asked is config and config == kept  # the config it was given is left as it was
    assert served.config is resolved and served.thresholds == served.config.thresholds == thresholds_of(PROFILE)


def test_calibration_asks_for_chains_of_its_gamma(tiny_dirs, viasd_home, probe, monkeypatch):
    from viasd_core.calibration.calibrate import run_calibration
    from viasd_core.loading.prompts import default_prompts

    asked = []

    def stop(session, request, *args, **kwargs):
        asked.append(request)
        raise UsageError("stopped before generating")

    monkeypatch.setattr(session_module, "resolve_config", stop)
    with pytest.raises(UsageError, match="stopped"):
        run_calibration(options(tiny_dirs), default_prompts()[:2], max_new_tokens=11, gamma=4,
                        profile_path=str(viasd_home / "p.json"))
    assert asked == [GenerationRequest(mode="sd", max_new_tokens=11, gamma=4, trees=False)]
