"""Slim verifier, tier router, threshold fit, profiles and `viasd calibrate` on tiny models."""

import copy
import json

import pytest
import torch

from support.cli_cases import invoke, prompt_file  # noqa: F401 (prompt_file: a fixture)
from conftest import FAMILIES, tiny_model
from viasd_core.calibration.costs import sd_outcome
from viasd_core.calibration.fit import fit_thresholds
from viasd_core.calibration.mask_search import MaskEvaluator, search_layer_mask
from viasd_core.errors import ViasdError
from viasd_core.runtime.model import FastModel
from viasd_core.loading.profile import Profile, find_profile, read_profile, save_profile
from viasd_core.speculation.router import OFF, BlockRecord, Thresholds, replay
from viasd_kernels import route_block


# ---------------------------------------------------------------------- pure router functions
def test_thresholds_must_be_ordered():
    with pytest.raises(ValueError):
        Thresholds(accept=0.3, slim=0.5)


def block(gate, draft_ok, slim_ok, eq, bonus=True, confidence=None):
    confidence = confidence or [1.0] * len(gate)
    return BlockRecord(tuple(gate), tuple(draft_ok), tuple(slim_ok), tuple(eq), bonus, tuple(confidence))


def test_replay_counts_tokens_errors_and_passes():
    b = block([1.0, 0.95, 0.5, 0.1], [True, False, True, True], [True, True, False, True], [True, False, True, True])
    # accept >= 0.9: positions 0, 1 accepted (1 is wrong); 0.3 <= 0.5 -> slim (same token as draft, wrong);
    # 0.1 -> full: one target pass, the target's token at 3 equals the draft, then the bonus (correct).
    out = replay([b], Thresholds(0.9, 0.3))
    assert (out.tokens, out.wrong, out.target_passes, out.slim_passes) == (5, 2, 1, 1)
    assert out.tiers == ["accept", "accept", "slim", "full", "bonus"] and out.fidelity == 1 - 2 / 5
    assert out.tier_counts == {"accept": 2, "slim": 1, "full": 1, "bonus": 1}
    # Everything off: exactly sd's result (accepted prefix + the target's token), fidelity 1.
    off = replay([b], Thresholds(OFF, OFF))
    assert (off.tokens, off.wrong, off.target_passes) == (2, 0, 1) and off.fidelity == 1.0
    assert sd_outcome([b]).tokens == 2
    # All accepted and the slim gives the bonus token without any target pass.
    allacc = replay([block([1.0, 1.0], [True, True], [True, True], [True, True], bonus=False)], Thresholds(0.5, 0.0))
    assert (allacc.tokens, allacc.wrong, allacc.target_passes) == (3, 1, 0)
    assert allacc.tiers == ["accept", "accept", "slim"] and allacc.fidelity == 1 - 1 / 3


def test_replay_without_tokens_has_no_fidelity():
    empty = replay([], Thresholds(0.9, 0.3))
    assert (empty.tokens, empty.wrong, empty.steps) == (0, 0, 0)
    assert empty.fidelity is None  # not measured, never 1.0


def test_replay_routes_recorded_gates_as_route_block_did():
    # The gate is float32; a threshold between it and the next float64 up rounds to it in float32,
    # where route_block compares: route_block accepts, and so must the replay of its gate.
    logits = torch.log(torch.tensor([[0.5, 0.15, 0.35], [0.6, 0.3, 0.1]]))
    draft_tokens = torch.tensor([1, 0])
    gate = route_block(logits, draft_tokens, 0.0, OFF, OFF).gate
    theta = gate[0].item() + 1e-10  # above the recorded value in float64, equal in float32
    assert theta > gate[0].item() and torch.tensor(theta, dtype=torch.float32) == gate[0]
    assert route_block(logits, draft_tokens, 0.0, theta, 0.0).tiers.tolist() == [0, 0]  # both accepted
    record = BlockRecord.from_choices(gate.tolist(), [1, 0], slim_argmax=[0, 0, 5], target_argmax=[1, 0, 5],
                                      confidence=[0.5, 0.6])
    assert record == BlockRecord(tuple(gate.tolist()), (True, True), (False, True), (False, True), True, (0.5, 0.6))
    out = replay([record], Thresholds(theta, 0.0))
    assert out.tiers == ["accept", "accept", "slim"] and out.wrong == 0


def test_fit_respects_budget_and_prefers_cheap_tiers():
    good = block([1.0, 1.0, 1.0], [True] * 3, [True] * 3, [True] * 3)
    risky = block([0.6, 0.6, 0.6], [False] * 3, [False] * 3, [True] * 3)
    blocks = [good] * 30 + [risky] * 2
    costs = {"target": 1.0, "slim": 0.3, "draft": 0.05}
    fit = fit_thresholds(blocks, costs, budget=0.01)
    assert fit.outcome.fidelity >= 0.99
    assert fit.thresholds.accept > 0.6  # the risky gate values must not be accepted
    assert fit.outcome.target_passes < len(blocks)  # the confident blocks skip the target
    assert fit.modeled_tokens_per_s > fit.sd_modeled_tokens_per_s
    loose = fit_thresholds(blocks, costs, budget=0.5)
    assert loose.modeled_tokens_per_s >= fit.modeled_tokens_per_s


def test_fit_without_recorded_tokens_keeps_both_tiers_off():
    # Nothing was replayed, so no threshold pair can be shown to meet the budget: viasd stays sd.
    fit = fit_thresholds([], {"target": 1.0, "slim": 0.3, "draft": 0.05}, budget=0.01)
    assert fit.thresholds == Thresholds(OFF, OFF)
    assert fit.outcome.tokens == 0 and fit.outcome.fidelity is None


# ---------------------------------------------------------------------- slim verifier
@pytest.mark.parametrize("family", FAMILIES)
def test_slim_with_nothing_skipped_equals_target(family):
    model = tiny_model(family, n_layers=5, seed=41)
    ids = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(0))
    full = FastModel(model, max_len=32).forward(ids, 0, 12)
    slim = FastModel(model, layer_ids=list(range(5)), max_len=32).forward(ids, 0, 12)
    assert torch.equal(full, slim)


@pytest.mark.parametrize("family", FAMILIES)
def test_slim_equals_reference_running_the_kept_layers(family):
    model = tiny_model(family, n_layers=6, seed=42)
    kept = [0, 2, 3, 5]
    reference = copy.deepcopy(model)
    reference.model.layers = torch.nn.ModuleList([reference.model.layers[i] for i in kept])
    reference.config.num_hidden_layers = len(kept)
    if getattr(reference.config, "layer_types", None):
        reference.config.layer_types = [reference.config.layer_types[i] for i in kept]
    ids = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference(ids[None], use_cache=False).logits[0]
    slim = FastModel(model, layer_ids=kept, max_len=32)
    got = torch.cat([slim.forward(ids[:9], 0, 9), slim.forward(ids[9:], 9, 5)])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # It shares the target's weights: no parameter is copied.
    assert slim.layers[1].self_attn.q_proj.weight.data_ptr() == model.model.layers[2].self_attn.q_proj.weight.data_ptr()


def test_mask_search_beats_or_matches_random_and_keeps_ends():
    model = tiny_model("llama", n_layers=8, seed=43)
    seqs = [torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    ev = MaskEvaluator(model, seqs)
    result = search_layer_mask(ev, skip_ratio=0.5, n_random=4)
    kept = result.best.layer_ids
    assert len(kept) == 4 and kept[0] == 0 and kept[-1] == 7
    assert result.best.agreement >= result.random_best.agreement
    assert ev.score(list(range(8))).agreement == 1.0


# ---------------------------------------------------------------------- profiles
def make_profile(**kw):
    base = dict(target_id="t", draft_id="d", quant="none", device="cpu", dtype="float32", layer_ids=[0, 2, 3],
                n_layers=4, theta_accept=0.9, theta_slim=0.4, budget=0.01, heldout_fidelity=0.995)
    base.update(kw)
    return Profile(**base)


def test_profile_round_trip_and_rejections(viasd_home, tmp_path):
    p = make_profile()
    path = save_profile(p)
    assert read_profile(path) == p
    assert find_profile("t", "d", "none", "cpu", 4) == p
    with pytest.raises(ViasdError, match="made for target 't' with draft 'd'"):
        find_profile("other", "d", "none", "cpu", 4, explicit=str(path))
    with pytest.raises(ViasdError, match="quantization 'none'"):
        find_profile("t", "d", "4bit", "cpu", 4, explicit=str(path))
    with pytest.raises(ViasdError, match="run `viasd calibrate --model other --draft d`"):
        find_profile("other", "d", "none", "cpu", 4)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ViasdError, match="corrupt"):
        read_profile(bad)
    bad.write_text(json.dumps({**p.to_json(), "layer_ids": [0, 9]}))
    with pytest.raises(ViasdError, match="corrupt"):
        read_profile(bad)


# ---------------------------------------------------------------------- the command
def test_calibrate_meets_budget_on_heldout_then_viasd_generates(tiny_dirs, viasd_home, prompt_file):
    # Only the layer mask on the target's own weights: which of several views wins is decided by timed
    # passes, which a tiny model's microseconds leave to the machine's noise (the choice among views is
    # tested in test_slim_view.py); the mask's layer count is what this test checks.
    args = ["-m", tiny_dirs["target"], "-d", tiny_dirs["target"], "--prompts", prompt_file, "-n", "24", "--skip-ratio", "0.5",
            "--slim-formats", "target"]
    r = invoke("calibrate", *args, "--budget", "0.05", "--json")
    assert r.exit_code == 0, r.stderr
    profile = json.loads(r.stdout)
    assert profile["heldout_fidelity"] >= 0.95 and profile["budget"] == 0.05
    assert len(profile["layer_ids"]) == 2 and profile["n_layers"] == 4
    assert "profile saved to" in r.stderr
    g = invoke("generate", "w1 w2 w3", "-m", tiny_dirs["target"], "-d", tiny_dirs["target"], "--mode", "viasd", "-n", "12", "--json", "-q")
    assert g.exit_code == 0, g.stderr
    row = json.loads(g.stdout)
    assert row["mode"] == "viasd"
    assert sum(row["stats"]["tier_counts"].values()) == row["new_tokens"] or row["finish_reason"] != "length"
    # The reported fidelity is that of the emitted tokens: the same run in-process, then the
    # target's greedy choices along it, counted here.
    from viasd_core.speculation.engine import GenerationConfig
    from viasd_core.loading.prompts import encode
    from viasd_core.session import build_session, thresholds_of
    from viasd_core.loading.options import ModelOptions

    session = build_session(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["target"])), mode="viasd")
    ids = encode(session.tokenizer, "w1 w2 w3")
    gen = session.engine.generate(ids, GenerationConfig(mode="viasd", max_new_tokens=12, thresholds=thresholds_of(session.profile)))
    assert gen.text == row["text"] and len(gen.tokens) == row["new_tokens"]
    with torch.no_grad():
        choices = session.target.model(torch.tensor([ids + gen.tokens])).logits[0, len(ids) - 1 : -1].argmax(-1).tolist()
    wrong = sum(a != b for a, b in zip(choices, gen.tokens))
    assert row["fidelity"] == pytest.approx((len(gen.tokens) - wrong) / len(gen.tokens), abs=1e-12)
    # The draft is the target itself: only the slim verifier's tokens can be wrong.
    assert wrong <= row["stats"]["tier_counts"]["slim"]
    # A profile for another pair is refused with the command that makes the right one.
    other = invoke("generate", "w1", "-m", tiny_dirs["target"], "-d", "ngram", "--mode", "viasd", "-q")
    assert other.exit_code == 1 and "run `viasd calibrate" in other.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--budget", "0"], "--budget must be in (0, 1)"),
        (["--budget", "1.5"], "--budget must be in (0, 1)"),
        (["--skip-ratio", "0.95"], "--skip-ratio must be in [0, 0.9]"),
    ],
)
def test_calibrate_bad_input(tiny_dirs, viasd_home, prompt_file, extra, message):
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", prompt_file, *extra)
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (viasd_home / "config" / "profiles").exists()


def test_calibrate_malformed_and_empty_prompt_files(tiny_dirs, viasd_home, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["w1 w2"]}\n{"turns": \n')
    r = invoke("calibrate", "-m", tiny_dirs["target"], "--prompts", bad)
    assert r.exit_code == 2 and "line 2 is not valid JSON" in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = invoke("calibrate", "-m", tiny_dirs["target"], "--prompts", empty)
    assert r.exit_code == 2 and "no prompts" in r.stderr
    assert not (viasd_home / "config" / "profiles").exists()


def test_calibrate_refuses_to_save_when_heldout_misses_the_budget(tiny_dirs, viasd_home, prompt_file, monkeypatch):
    import viasd_core.calibration.candidates as cal

    real_fit = cal.fit_thresholds

    def reckless_fit(blocks, costs, budget, grid=24):  # accepts everything: certain to miss
        fit = real_fit(blocks, costs, budget)
        fit.thresholds = Thresholds(0.0, 0.0)
        return fit

    monkeypatch.setattr(cal, "fit_thresholds", reckless_fit)
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", prompt_file, "-n", "16", "--budget", "0.001")
    assert r.exit_code == 1
    assert "misses the budget" in r.stderr and "profile not saved" in r.stderr
    assert not (viasd_home / "config" / "profiles").exists()


def test_run_prompts_reports_fidelity_only_where_measured():
    from conftest import TinyTokenizer
    from viasd_core.calibration.runs import run_prompts
    from viasd_core.speculation.engine import Engine, GenerationConfig

    target = tiny_model("llama", n_layers=2, seed=46)
    prompts = [torch.randint(3, 256, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    engine = Engine(FastModel(target, max_len=64), TinyTokenizer())
    config = GenerationConfig(mode="ar", max_new_tokens=5)
    unmeasured = run_prompts(engine, target, prompts, config, measure_fidelity=False)
    assert unmeasured.fidelity is None and unmeasured.stats.fidelity is None and unmeasured.stats.new_tokens == 10
    measured = run_prompts(engine, target, prompts, config)
    assert measured.fidelity == 1.0  # ar is the target's own greedy choice, measured teacher-forced


def test_calibration_with_nothing_to_replay_reports_not_measured(tiny_dirs, viasd_home, prompt_file, tmp_path):
    import io

    from rich.console import Console

    from viasd_cli.calibrate import report_table
    from viasd_core.calibration.calibrate import run_calibration
    from viasd_core.loading.prompts import load_prompts
    from viasd_core.loading.options import ModelOptions

    # One new token per prompt: every step is a plain target step, no block is recorded.
    out = tmp_path / "profile.json"
    report = run_calibration(ModelOptions(model=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"])),
                             load_prompts(str(prompt_file), limit=4), budget=0.05, skip_ratio=0.5, max_new_tokens=1,
                             profile_path=out)
    assert report.fit.outcome.tokens == 0 and report.fit.thresholds == Thresholds(OFF, OFF)
    assert report.fit.outcome.fidelity is None and report.profile.fit_fidelity is None
    assert report.heldout_sd.fidelity is None  # sd's fidelity is not re-measured: not 1.0
    assert report.heldout_viasd.fidelity == 1.0 and report.met_budget  # measured: the target's own tokens
    saved = json.loads(out.read_text())
    assert saved["fit_fidelity"] is None and saved["heldout_fidelity"] == 1.0
    assert read_profile(out).fit_fidelity is None
    text = io.StringIO()
    Console(file=text, width=200).print(report_table(report))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in text.getvalue().splitlines() if line.count("│") == 3}
    assert rows["fit fidelity (replayed)"] == "not measured"
    assert rows["held-out fidelity (measured)"] == "1.0000"


def test_viasd_with_both_tiers_off_is_sd_without_slim_passes():
    from conftest import TinyTokenizer
    from viasd_core.speculation.drafters import ModelDrafter
    from viasd_core.speculation.engine import Engine, GenerationConfig

    target = tiny_model("llama", n_layers=4, seed=44)
    draft = tiny_model("llama", n_layers=1, seed=45)
    prompt = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(2)).tolist()

    def engine():
        return Engine(FastModel(target, max_len=96), TinyTokenizer(), drafter=ModelDrafter(FastModel(draft, max_len=96), 256),
                      slim=FastModel(target, layer_ids=[0, 3], max_len=96))

    sd_engine, off_engine = engine(), engine()
    sd = sd_engine.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=30, gamma=4))
    off = off_engine.generate(prompt, GenerationConfig(mode="viasd", max_new_tokens=30, gamma=4, thresholds=Thresholds(OFF, OFF)))
    assert off.tokens == sd.tokens and off.stats.slim_passes == 0
    # a slim verifier the mode never runs is not even prefilled (no pass at all)
    assert sd_engine.slim.passes == off_engine.slim.passes == 0
    active = off_engine.generate(prompt, GenerationConfig(mode="viasd", max_new_tokens=30, gamma=4,
                                                          thresholds=Thresholds(0.9, 0.5)))
    assert active.stats.slim_passes > 0 and off_engine.slim.passes > active.stats.slim_passes  # prefilled, then run
    assert replay([block([0.5], [True], [True], [True])], Thresholds(OFF, OFF)).slim_passes == 0


@pytest.mark.parametrize("block", [3, 4, 6])
def test_pass_costs_time_the_shapes_generation_runs(block):
    """Every timed pass has a decode shape that runs compiled (a block verify returns all its rows):
    a block timed with one logit row ran eagerly beside a compiled 1-token pass (issue 22 item 3)."""
    from viasd_core.calibration.costs import pass_costs
    from viasd_core.runtime.model import pass_width

    fast = FastModel(tiny_model("llama", seed=3), max_len=64)
    shapes = []
    inner = fast.forward

    def forward(input_ids, start, n_logits=1):
        T = input_ids.shape[0]
        if start > 0:  # the timed passes (the cached context's prefill starts at 0)
            shapes.append((pass_width(T), pass_width(T) if n_logits > 1 else 1))  # as FastModel.forward
        return inner(input_ids, start, n_logits=n_logits)

    fast.forward = forward
    costs = pass_costs(fast, "target", block, context=16, repeats=3)
    assert set(costs) == {"target", "target_1"} and costs["target"] > 0 and costs["target_1"] > 0
    assert shapes and all(shape in fast.graph_shapes() for shape in shapes), shapes
    assert (pass_width(block), pass_width(block)) in shapes and (1, 1) in shapes


def test_a_candidate_view_is_attached_before_its_costs_are_measured(monkeypatch):
    """The slim view's pass costs are taken once the engine has attached it (sized, and compiled and
    warmed up when the engine is), so the costs are those of the passes the run will make."""
    from viasd_core.calibration import candidates as cand_mod
    from viasd_core.speculation.engine import Engine, GenerationConfig
    from viasd_core.speculation.drafters import NgramDrafter
    from viasd_core.runtime.slim_view import SlimView, TARGET_WEIGHTS
    from conftest import TinyTokenizer

    model = tiny_model("llama", n_layers=6, seed=1)
    engine = Engine(FastModel(model, max_len=64), TinyTokenizer(), drafter=NgramDrafter())
    attached_when_timed = []

    def fake_costs(slim, name, block, *a, **k):
        attached_when_timed.append(engine.slim is slim)
        return {"slim": 1e-3, "slim_1": 1e-3}

    monkeypatch.setattr(cand_mod, "pass_costs", fake_costs)
    monkeypatch.setattr(cand_mod, "collect_blocks", lambda *a, **k: [])
    ids = [list(range(5, 25))]
    evaluator = MaskEvaluator(model, ids)
    views = [SlimView(tuple(range(0, 6, 2)), TARGET_WEIGHTS), SlimView(tuple(range(4)), TARGET_WEIGHTS)]
    got = cand_mod.measure_candidates(engine, evaluator, views, ids, GenerationConfig(gamma=3), {"target": 2e-3,
                                      "target_1": 2e-3, "draft": 0.0, "block": 4}, budget=0.01)
    assert len(got) == 2 and attached_when_timed == [True, True]
