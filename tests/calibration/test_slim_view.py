"""Slim views over layers x weight format: the packed twin, the candidates calibration compares,
the confidence condition, and the modes that run a view (exact stays exact, viasd, ar-slim)."""

import json

import pytest
import torch

from conftest import TinyTokenizer, tiny_model
from support.cli_cases import invoke, prompt_file  # noqa: F401 (prompt_file: a fixture)
from viasd_core.runtime import slim_view
from viasd_core.calibration.candidates import Candidate, choose_candidate, parse_slim_formats, slim_candidates
from viasd_core.calibration.costs import modeled_tokens_per_s, pass_seconds
from viasd_core.calibration.fit import Fit, fidelity_lower_bound, fit_thresholds
from viasd_core.calibration.runs import collect_blocks
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.errors import UsageError, ViasdError
from viasd_core.loading.models import load_model
from viasd_core.runtime.model import FastModel
from viasd_core.loading.profile import read_profile, save_profile
from viasd_core.speculation.router import OFF, BlockRecord, ReplayOutcome, Thresholds, replay, route_tiers
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.slim_view import TARGET_WEIGHTS, SlimView, lower_formats, release_twins, slim_verifier, slim_weights
from viasd_core.runtime.weight_formats import PackedLinear, has_weight_format, packed_bytes, packed_copy, weight_bytes
from viasd_kernels import TIER_ACCEPT as A
from viasd_kernels import TIER_FULL as F
from viasd_kernels import TIER_SLIM as S

pytest.importorskip("torchao")  # CI installs it (the quant extra); the formats need it

NEW = 24


def prompt(seed: int, length: int = 10) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(400 + seed)).tolist()


# ---------------------------------------------------------------------- the packed twin
@pytest.mark.parametrize("family, tied", [("llama", False), ("gemma", True), ("qwen3", False)])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_packed_copy_equals_loading_at_that_format_and_leaves_the_target_alone(tmp_path, family, tied, quant):
    target = tiny_model(family, seed=3, tie_word_embeddings=tied)
    target.save_pretrained(tmp_path)
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    twin = packed_copy(target, WeightFormat.parse(quant))
    # the target is untouched: float weights, same values, no packed layer
    assert not has_weight_format(target) and has_weight_format(twin)
    assert all(torch.equal(before[n], p) for n, p in target.named_parameters())
    assert next(target.parameters()).dtype == torch.float32 and twin.get_input_embeddings().weight.dtype == torch.bfloat16
    assert isinstance(twin.get_output_embeddings(), PackedLinear) and twin.get_output_embeddings().kind == "int8"
    # the twin is what `--quant quant` loads
    loaded = load_model(str(tmp_path), quant=quant, with_tokenizer=False).model
    ids = torch.tensor([prompt(1)])
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, loaded(ids).logits)
    # the memory estimate made before packing (RoPE buffers aside)
    assert abs(packed_bytes(target, WeightFormat.parse(quant)) - weight_bytes(twin)) <= 256


def test_twins_are_made_once_shared_and_released():
    target = tiny_model("llama", seed=4)
    assert slim_weights(target, TARGET_WEIGHTS) is target
    twin = slim_weights(target, "int4")
    assert slim_weights(target, "int4") is twin  # one twin per format, shared by every view
    fast = FastModel(target, max_len=64)
    a = slim_verifier(fast, SlimView((0, 1, 2, 3), "int4"))
    b = slim_verifier(fast, SlimView((0, 3), "int4"))
    assert a.hf_model is b.hf_model is twin and a.layers[0] is b.layers[0]
    assert not a.row_attention and a.dtype == torch.bfloat16 and fast.dtype == torch.float32
    release_twins(target, keep={"int8"})
    assert slim_weights(target, "int4") is not twin


def test_a_twin_that_does_not_fit_is_refused_in_one_line(monkeypatch):
    target = tiny_model("llama", seed=5)
    monkeypatch.setattr(slim_view, "free_memory_bytes", lambda device: 1000)
    with pytest.raises(ViasdError) as e:
        slim_weights(target, "int8")
    assert "GiB" in e.value.message and "--slim-formats target" in e.value.message and "\n" not in e.value.message


def test_lower_formats_and_the_slim_formats_option(monkeypatch):
    assert lower_formats(WeightFormat.parse("none")) == ("int8", "int4")
    assert lower_formats(WeightFormat.parse("int8")) == ("int4",)
    assert lower_formats(WeightFormat.parse("int4")) == () and lower_formats(WeightFormat.parse("4bit")) == ()
    assert parse_slim_formats("auto", WeightFormat.parse("none")) == ("int8", "int4")
    assert parse_slim_formats("target", WeightFormat.parse("none")) == ()
    assert parse_slim_formats("int4, int8,int4", WeightFormat.parse("none")) == ("int4", "int8")
    with pytest.raises(UsageError, match="unknown --slim-formats"):
        parse_slim_formats("int3")
    with pytest.raises(UsageError, match="not below the target's precision"):
        parse_slim_formats("int8", WeightFormat.parse("int4"))
    monkeypatch.setattr(slim_view.importlib.util, "find_spec", lambda name: None)
    assert lower_formats(WeightFormat.parse("none")) == ()
    with pytest.raises(UsageError, match="torchao is not installed"):
        parse_slim_formats("int4", WeightFormat.parse("none"))


# ---------------------------------------------------------------------- candidates and the choice
def test_slim_candidates_cover_both_axes_without_duplicates():
    views = slim_candidates([0, 2, 3], 4, ("int8", "int4"))
    assert views == [SlimView((0, 2, 3)), SlimView((0, 1, 2, 3), "int8"), SlimView((0, 2, 3), "int8"),
                     SlimView((0, 1, 2, 3), "int4"), SlimView((0, 2, 3), "int4")]
    # skipping no layer: the all-layer view on the target's weights stays (it is the target itself)
    assert slim_candidates([0, 1, 2, 3], 4, ("int4",)) == [SlimView((0, 1, 2, 3)), SlimView((0, 1, 2, 3), "int4")]


def fit_of(speed: float, active: bool = True) -> Fit:
    th = Thresholds(1.0, 0.0) if active else Thresholds(OFF, OFF)
    return Fit(th, ReplayOutcome(), modeled_tokens_per_s=speed, sd_modeled_tokens_per_s=10.0)


def test_choose_candidate_keeps_the_best_modeled_speedup():
    mask = Candidate(SlimView((0, 3)), fit=fit_of(10.0, active=False))
    int8 = Candidate(SlimView((0, 1, 2, 3), "int8"), fit=fit_of(12.0))
    int4 = Candidate(SlimView((0, 1, 2, 3), "int4"), fit=fit_of(14.0))
    big = Candidate(SlimView((0, 1, 2, 3), "int4"), skipped="does not fit")
    assert choose_candidate([mask, int8, int4, big]) is int4
    assert int4.speedup == pytest.approx(1.4) and big.speedup is None
    # every fit left the tiers off: the view without a copy (the first measured)
    off8 = Candidate(SlimView((0, 1, 2, 3), "int8"), fit=fit_of(10.0, active=False))
    assert choose_candidate([big, mask, off8]) is mask
    with pytest.raises(ViasdError, match="no slim view could be measured"):
        choose_candidate([big])
    row = int4.to_json()
    assert row["weights"] == "int4" and row["modeled_speedup"] == pytest.approx(1.4) and row["theta_confidence"] == 0.0


# ---------------------------------------------------------------------- confidence, costs, margin
def test_route_tiers_sends_unsure_positions_to_the_target():
    gate = torch.tensor([1.0, 1.0, 0.5, 0.05])
    confidence = torch.tensor([0.9, 0.3, 0.9, 0.9])
    assert route_tiers(gate, confidence, Thresholds(0.8, 0.1)).tolist() == [A, A, S, F]
    assert route_tiers(gate, confidence, Thresholds(0.8, 0.1, 0.5)).tolist() == [A, F, S, F]
    assert not Thresholds(0.8, 0.1, OFF).active and Thresholds(0.8, 0.1, 0.99).active
    with pytest.raises(ValueError):
        Thresholds(0.8, 0.1, -0.1)


def record(gate, draft_ok, slim_ok, eq, confidence, bonus=True):
    return BlockRecord(tuple(gate), tuple(draft_ok), tuple(slim_ok), tuple(eq), bonus, tuple(confidence))


def test_replay_counts_the_positions_a_lagging_target_catches_up_on():
    sure = record([1.0, 1.0], [True] * 2, [True] * 2, [True] * 2, [0.9, 0.9])  # kept whole: 3 tokens, no target
    unsure = record([1.0, 1.0, 1.0], [True] * 3, [True] * 3, [True] * 3, [0.9, 0.2, 0.9])
    out = replay([sure, sure, unsure], Thresholds(0.5, 0.0, 0.5))
    assert out.tiers == ["accept"] * 2 + ["slim"] + ["accept"] * 2 + ["slim"] + ["accept", "full", "full", "bonus"]
    assert out.target_passes == 1 and out.target_positions == 3 + 3 + (3 + 1)  # two skipped blocks, then its own
    assert out.slim_passes == 3 and out.slim_positions == 3 + 3 + 4
    costs = {"block": 4, "target": 1.3, "target_1": 1.0, "slim": 0.4, "slim_1": 0.25, "draft": 0.01}
    assert pass_seconds(costs, "target", 1, 10) == pytest.approx(1.0 + 0.1 * 9)  # linear in the width
    assert pass_seconds(costs, "slim", 3, 10) == pytest.approx(3 * 0.25 + 0.05 * 7)
    assert pass_seconds({"target": 1.3}, "target", 2, 10) == pytest.approx(2.6)  # only the block measured: flat
    seconds = 7 * 0.01 + 1.9 + 3 * 0.25 + 0.05 * 7
    assert modeled_tokens_per_s(out, costs) == pytest.approx(out.tokens / seconds)


def test_the_fit_keeps_a_margin_below_the_budget():
    assert fidelity_lower_bound(ReplayOutcome()) is None
    perfect = ReplayOutcome(tiers=["slim"] * 100)
    assert fidelity_lower_bound(perfect, z=1.0) == pytest.approx(100 / 101)
    assert fidelity_lower_bound(perfect, z=0.0) == 1.0
    # 300 blocks: the draft and the slim are right wherever the slim is sure, wrong where it is not.
    good = record([1.0, 1.0], [True] * 2, [True] * 2, [True] * 2, [0.9, 0.9])
    unsure = record([1.0], [False], [False], [True], [0.2], bonus=True)
    blocks = [good] * 292 + [unsure] * 8
    costs = {"target": 1.0, "slim": 0.2, "draft": 0.01}
    loose = fit_thresholds(blocks, costs, budget=0.01, z=0.0)  # 8 wrong of 892: meets 0.99 without a margin
    assert loose.thresholds.confidence == 0.0 and loose.outcome.wrong == 8
    strict = fit_thresholds(blocks, costs, budget=0.01, z=1.0)  # with one: the unsure ones go to the target
    assert strict.thresholds.active and strict.outcome.wrong == 0 and 0.2 < strict.thresholds.confidence <= 0.9


# ---------------------------------------------------------------------- modes on a twin
def assert_greedy_choices(model, prompt_ids, tokens, positions):
    """tokens[i] is `model`'s greedy choice at every i in `positions`, up to bf16 rounding:
    transformers' forward over the whole text rounds bf16 attention differently from our short
    passes, so a near tie (2 bf16 steps at the top logit) may go either way; no more than 2 do. The
    forward runs the packed formats' decode kernels at every row (not the dense prefill product: each
    packed layer's bound threshold lifted for the call)."""
    from viasd_core.runtime import packed_linear

    layers = [m for m in model.modules() if isinstance(m, packed_linear.PackedLinear)]
    bound = [m._dense_rows for m in layers]
    try:
        for m in layers:
            m._dense_rows = packed_linear.NO_DENSE_ROWS
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1].float()
    finally:
        for m, rows in zip(layers, bound):
            m._dense_rows = rows
    ties = 0
    for i in positions:
        top = logits[i].max()
        assert logits[i, tokens[i]] >= top - 2 * torch.finfo(torch.bfloat16).eps * top.abs(), i
        ties += int(logits[i].argmax() != tokens[i])
    assert positions and ties <= 2
def twin_engine(seed: int = 7):
    target = tiny_model("llama", n_layers=4, seed=seed)
    draft = tiny_model("llama", n_layers=1, seed=seed + 1)
    fast = FastModel(target, max_len=128)
    slim = slim_verifier(fast, SlimView((0, 1, 2, 3), "int4"))
    drafter = ModelDrafter(FastModel(draft, max_len=128, name="draft"), fast.shape.vocab_size)
    return Engine(fast, TinyTokenizer(), drafter=drafter, slim=slim), target


def test_exact_with_an_int4_twin_is_token_identical_to_ar():
    engine, _ = twin_engine()
    for seed in range(3):
        p = prompt(seed)
        ar = engine.generate(p, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        for gamma in (1, 4):
            got = engine.generate(p, GenerationConfig(mode="exact", max_new_tokens=NEW, gamma=gamma, adaptive=False))
            assert got.tokens == ar
            assert got.stats.slim_passes > 0


def test_sd_records_the_slim_over_the_drafted_block():
    """The slim runs over the draft's tokens, as viasd's slim pass does: an all-layer view on the
    target's weights agrees with the target at every recorded position, also after a rejection."""
    target = tiny_model("llama", n_layers=4, seed=9)
    draft = tiny_model("llama", n_layers=1, seed=10)
    fast = FastModel(target, max_len=128)
    drafter = ModelDrafter(FastModel(draft, max_len=128, name="draft"), fast.shape.vocab_size)
    engine = Engine(fast, TinyTokenizer(), drafter=drafter, slim=slim_verifier(fast, SlimView((0, 1, 2, 3))))
    per_prompt = collect_blocks(engine, [prompt(s) for s in range(3)], GenerationConfig(max_new_tokens=NEW, gamma=4))
    blocks = [b for per in per_prompt for b in per]
    assert any(not all(b.draft_ok[:-1]) for b in blocks), "the case needs rejections before a block's end"
    assert all(all(b.slim_ok) and b.slim_bonus_ok and b.draft_eq_slim == b.draft_ok for b in blocks)
    assert all(0 < c <= 1 for b in blocks for c in b.confidence)


def test_viasd_on_an_int4_twin_emits_its_tokens_and_reports_fidelity():
    engine, target = twin_engine(seed=11)
    p = prompt(4)
    gen = engine.generate(p, GenerationConfig(mode="viasd", max_new_tokens=NEW, gamma=4, adaptive=False,
                                              thresholds=Thresholds(OFF, 0.0)))  # every token: the slim tier
    # the target runs at most for a last single token (a plain step: nothing left to draft)
    assert set(gen.tiers[:-1]) == {"slim"} and gen.stats.target_passes <= 1
    # the slim tier's tokens are the twin's own greedy choices
    slim_positions = [i for i, tier in enumerate(gen.tiers) if tier == "slim"]
    assert_greedy_choices(slim_weights(target, "int4"), p, gen.tokens, slim_positions)


# ---------------------------------------------------------------------- profiles
def test_profile_records_the_view_and_reads_version_1(tmp_path, viasd_home):
    from viasd_core.loading.profile import Profile

    prof = Profile("t", "d", "none", "cpu", "float32", [0, 1, 2, 3], 4, 1.0, 0.0, 0.01, 0.995,
                   theta_confidence=0.42, slim_weights="int4", candidates=[{"weights": "int4"}])
    path = save_profile(prof, tmp_path / "p.json")
    back = read_profile(path)
    assert back.view == SlimView((0, 1, 2, 3), "int4") and back.theta_confidence == 0.42 and back.candidates
    data = json.loads(path.read_text())
    for key in ("slim_weights", "theta_confidence", "candidates"):
        del data[key]
    data["version"] = 1
    path.write_text(json.dumps(data))
    old = read_profile(path)
    assert old.view == SlimView((0, 1, 2, 3), TARGET_WEIGHTS) and old.theta_confidence == 0.0
    data["version"], data["slim_weights"] = 2, "int3"
    path.write_text(json.dumps(data))
    with pytest.raises(ViasdError, match="corrupt"):
        read_profile(path)


# ---------------------------------------------------------------------- end to end
def test_calibrate_compares_views_and_the_modes_run_the_chosen_one(tiny_dirs, viasd_home, prompt_file, tmp_path):
    out = tmp_path / "profile.json"
    pair = ["-m", tiny_dirs["target"], "-d", tiny_dirs["draft"]]
    r = invoke("calibrate", *pair, "--prompts", prompt_file, "-n", "16", "--skip-ratio", "0.5", "--budget", "0.3",
               "--slim-formats", "int4", "--force", "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    prof = json.loads(r.stdout)
    views = [(c["weights"], len(c["layer_ids"])) for c in prof["candidates"]]
    assert views == [("target", 2), ("int4", 4), ("int4", 2)]
    measured = [c for c in prof["candidates"] if c["modeled_speedup"] is not None]
    assert len(measured) == 3 and all(0 <= c["agreement"] <= 1 and c["costs"]["slim"] > 0 for c in measured)
    target_model = load_model(str(tiny_dirs["target"]), with_tokenizer=False).model
    assert [c["extra_bytes"] for c in prof["candidates"]] == [0] + [weight_bytes(packed_copy(target_model, WeightFormat.parse("int4")))] * 2
    chosen = next(c for c in prof["candidates"] if (c["weights"], c["layer_ids"]) == (prof["slim_weights"], prof["layer_ids"]))
    active = [c for c in measured if c["theta_accept"] <= 1 or c["theta_slim"] <= 1]
    assert chosen["modeled_speedup"] == max(c["modeled_speedup"] for c in measured) if active else chosen is measured[0]
    assert "slim view" in r.stderr and "agreement" in r.stderr
    # the modes load the chosen view from the profile; exact stays exact
    ar = invoke("generate", "w11 w12 w13", *pair, "--mode", "ar", "-n", "12", "--json", "-q")
    exact = invoke("generate", "w11 w12 w13", *pair, "--mode", "exact", "-n", "12", "--json", "-q", "--profile", out)
    viasd = invoke("generate", "w11 w12 w13", *pair, "--mode", "viasd", "-n", "12", "--json", "-q", "--profile", out)
    assert ar.exit_code == exact.exit_code == viasd.exit_code == 0, exact.stderr + viasd.stderr
    assert json.loads(exact.stdout)["text"] == json.loads(ar.stdout)["text"]
    assert json.loads(viasd.stdout)["fidelity"] is not None


def test_calibrate_rejects_a_slim_format_that_is_not_cheaper(tiny_dirs, viasd_home, prompt_file):
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", prompt_file,
               "--quant", "int4", "--slim-formats", "int8")
    assert r.exit_code == 2 and "not below the target's precision" in r.stderr and "Traceback" not in r.stderr
    r = invoke("calibrate", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--prompts", prompt_file,
               "--slim-formats", "fp8")
    assert r.exit_code == 2 and "unknown --slim-formats" in r.stderr


def test_bench_ar_slim_runs_the_view_alone_with_fidelity_against_the_target(tiny_dirs, viasd_home, prompt_file, tmp_path):
    from viasd_core.loading.profile import Profile
    from viasd_core.loading.prompts import encode, load_prompts

    loaded = load_model(str(tiny_dirs["target"]))
    draft_id = load_model(str(tiny_dirs["draft"]), with_tokenizer=False).model_id
    prof = Profile(loaded.model_id, draft_id, "none", "cpu", "float32", [0, 1, 2, 3], 4, OFF, OFF, 0.01, 1.0,
                   slim_weights="int4")
    path = save_profile(prof, tmp_path / "p.json")
    out = tmp_path / "run"
    r = invoke("bench", "-m", tiny_dirs["target"], "-d", tiny_dirs["draft"], "--methods", "ar,ar-slim", "--prompts",
               prompt_file, "--limit", "2", "-n", "10", "--warmup", "0", "--profile", path, "--out", out, "--quiet")
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row["method"] == "ar-slim" and row["status"] == "ok"]
    assert len(rows) == 2
    twin = packed_copy(loaded.model, WeightFormat.parse("int4"))
    texts = {p.id: p.text for p in load_prompts(str(prompt_file))}
    for row in rows:
        ids = encode(loaded.tokenizer, texts[row["prompt_id"]])
        assert_greedy_choices(twin, ids, row["tokens"], list(range(len(row["tokens"]))))  # the view alone
        with torch.no_grad():  # its fidelity is measured against the float32 target
            target_choices = loaded.model(torch.tensor([ids + row["tokens"]])).logits[0, len(ids) - 1 : -1].argmax(-1)
        agree = sum(int(a == b) for a, b in zip(target_choices.tolist(), row["tokens"]))
        assert row["fidelity"] == pytest.approx(agree / len(row["tokens"]), abs=1e-12)


def test_a_feature_draft_reads_a_bfloat16_views_features_in_the_targets_dtype():
    from support.head_cases import make_head

    from viasd_core.speculation.feature_drafter import FeatureDrafter

    target = tiny_model("llama", n_layers=5, seed=12)
    fast = FastModel(target, max_len=128)
    drafter = FeatureDrafter(make_head(target, seed=12), fast)
    engine = Engine(fast, TinyTokenizer(), drafter=drafter, slim=slim_verifier(fast, SlimView(tuple(range(5)), "int4")))
    assert engine.slim.cache.features.dtype == torch.bfloat16 and fast.dtype == torch.float32
    read = []
    inner = drafter._features

    def spy(start, end):
        feats = inner(start, end)
        read.append((end > fast.seen, None if feats is None else feats.dtype))
        return feats

    drafter._features = spy
    gen = engine.generate(prompt(6), GenerationConfig(mode="viasd", max_new_tokens=NEW, gamma=3, adaptive=False,
                                                      thresholds=Thresholds(OFF, 0.0)))
    assert gen.stats.draft_tokens > 0
    assert any(lagging for lagging, _ in read)  # some proposals came from the view's features alone
    assert {dtype for _, dtype in read if dtype is not None} == {torch.float32}
