"""`viasd bench`: file schema, summary recomputed from the JSON lines, plots, skipped/failed methods,
fidelity, HF parity, the reduced-vocabulary assistant wrapper, and the synthetic projection maths."""

import json
import math
import statistics

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_model
from viasd_cli.app import get_app
from viasd_core.bench import harness as core
from viasd_core.bench import runners
from viasd_core.loading import synthetic as syn
from viasd_core.bench.plots import PLOTS

PROMPTS = [
    {"question_id": 81, "category": "writing", "turns": ["w1 w2 w3 w4 w1 w2 w3"]},
    {"question_id": 82, "category": "coding", "turns": ["w9 w8 w7 w9 w8"]},
]
ROW_KEYS = {"method", "category", "prompt_id", "repeat", "new_tokens", "wall_s", "tokens_per_s", "target_passes",
            "accepted_lengths", "tier_shares", "fidelity", "status"}
METHOD_KEYS = {"status", "reason", "tokens_per_s_mean", "tokens_per_s_std", "speedup_vs_ar", "speedup_vs_hf",
               "mean_accepted_length", "acceptance_rate", "tier_shares", "fidelity_mean", "fidelity_min",
               "peak_memory_bytes", "by_category"}
META_KEYS = {"label", "device_name", "torch", "transformers", "viasd", "python", "target", "draft", "quant", "dtype",
             "command", "date"}


def run(*args):
    return CliRunner().invoke(get_app(), ["bench", *map(str, args)])


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "spec.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def tiny_args(tiny_dirs, prompt_file, *extra, draft=None):
    return ("-m", tiny_dirs["target"], "-d", draft or tiny_dirs["draft"], "--prompts", prompt_file, "-n", "8",
            "--device", "cpu", *extra)


def ok_rows(rows, method):
    return [r for r in rows if r["method"] == method and r["status"] == "ok"]


def test_full_run_files_schema_summary_plots(tiny_dirs, viasd_home, prompt_file, tmp_path):
    out = tmp_path / "run"
    r = run(*tiny_args(tiny_dirs, prompt_file, "--out", out, "--repeats", "2", "--breakdown"))
    assert r.exit_code == 0, r.stderr
    assert "tok/s" in r.stdout and "Where the time goes" in r.stdout and "TTFT ms" in r.stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())

    # rows: one per (method, prompt, repeat) that ran, one status line per skipped method
    for m in ("ar", "hf", "hf-assisted", "hf-pld", "sd"):
        rs = ok_rows(rows, m)
        assert sorted((r["prompt_id"], r["repeat"]) for r in rs) == [("81", 0), ("81", 1), ("82", 0), ("82", 1)]
        for row in rs:
            assert set(row) >= ROW_KEYS
            assert 1 <= row["new_tokens"] <= 8 and row["new_tokens"] == len(row["tokens"])
            assert row["tokens_per_s"] == pytest.approx(row["new_tokens"] / row["wall_s"])
            assert row["target_passes"] >= 1 and sum(row["accepted_lengths"]) == row["new_tokens"]
            assert row["category"] == {"81": "writing", "82": "coding"}[row["prompt_id"]]
            assert 0.0 <= row["fidelity"] <= 1.0
            if m in ("ar", "sd"):  # our engine's runs time their first token; transformers' are not measured
                assert 0.0 < row["ttft_s"] <= row["wall_s"]
            else:
                assert row["ttft_s"] is None
    for m in ("exact", "viasd"):
        (row,) = [r for r in rows if r["method"] == m]
        assert row["status"] == "skipped" and "viasd calibrate" in row["reason"] and row["tokens_per_s"] is None
        assert summary["methods"][m]["status"] == "skipped" and "viasd calibrate" in summary["methods"][m]["reason"]

    # fidelity is measured for every method; ar and sd (exact modes) are 1.0
    for m in ("ar", "sd", "hf", "hf-assisted", "hf-pld"):
        assert all(r["fidelity"] == 1.0 for r in ok_rows(rows, m)), m
    # transformers greedy and our ar give the same tokens (fp32); so do the exact speculative methods
    by_prompt = lambda m: {(r["prompt_id"], r["repeat"]): r["tokens"] for r in ok_rows(rows, m)}  # noqa: E731
    for m in ("hf", "hf-assisted", "hf-pld", "sd"):
        assert by_prompt(m) == by_prompt("ar"), m
    assert all(r["target_passes"] == r["new_tokens"] for r in ok_rows(rows, "hf"))  # one pass per token

    # summary agrees with the JSON lines
    assert set(summary["meta"]) >= META_KEYS and summary["meta"]["label"] == "measurement"
    assert summary["meta"]["target"]["id"] == "target" and summary["meta"]["draft"]["id"] == "draft"
    methods = summary["methods"]
    assert list(methods) == list(core.METHODS)
    mean = {m: statistics.mean(r["tokens_per_s"] for r in ok_rows(rows, m)) for m in ("ar", "hf", "hf-assisted", "hf-pld", "sd")}
    for m, tps in mean.items():
        s = methods[m]
        assert set(s) >= METHOD_KEYS and s["status"] == "ok" and s["runs"] == 4
        assert s["tokens_per_s_mean"] == pytest.approx(tps)
        assert s["tokens_per_s_std"] == pytest.approx(statistics.stdev(r["tokens_per_s"] for r in ok_rows(rows, m)))
        assert s["speedup_vs_ar"] == pytest.approx(tps / mean["ar"])
        assert s["speedup_vs_hf"] == pytest.approx(tps / mean["hf"])
        new = sum(r["new_tokens"] for r in ok_rows(rows, m))
        assert s["mean_accepted_length"] == pytest.approx(new / sum(r["target_passes"] for r in ok_rows(rows, m)))
        assert s["fidelity_mean"] == 1.0 and s["fidelity_min"] == 1.0 and s["peak_memory_bytes"] > 0
        ttft = [r["ttft_s"] for r in ok_rows(rows, m) if r["ttft_s"] is not None]
        assert s["ttft_s_mean"] == (pytest.approx(statistics.mean(ttft)) if m in ("ar", "sd") else None)
        for cat in ("writing", "coding"):
            cat_mean = statistics.mean(r["tokens_per_s"] for r in ok_rows(rows, m) if r["category"] == cat)
            assert s["by_category"][cat]["tokens_per_s_mean"] == pytest.approx(cat_mean)
    assert methods["ar"]["speedup_vs_ar"] == pytest.approx(1.0) and methods["ar"]["mean_accepted_length"] == 1.0
    sd_rows = ok_rows(rows, "sd")
    attempts = sum(sum(r["position_attempts"]) for r in sd_rows)
    assert methods["sd"]["acceptance_rate"] == pytest.approx(sum(sum(r["position_accepts"]) for r in sd_rows) / attempts)
    assert sum(methods["sd"]["tier_shares"].values()) == pytest.approx(1.0)
    assert methods["hf"]["tier_shares"] is None and methods["hf"]["acceptance_rate"] is None
    assert set(methods["sd"]["breakdown"]) == set(core.PHASES)

    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024, name
    assert sorted(p.name for p in out.iterdir()) == sorted(["results.jsonl", "summary.json", *PLOTS])  # no temporary files


def test_exact_and_viasd_with_a_profile(tiny_dirs, viasd_home, prompt_file, tmp_path):
    from viasd_core.loading.profile import Profile, save_profile

    profile = save_profile(Profile(target_id="target", draft_id="target", quant="none", device="cpu", dtype="float32",
                                   layer_ids=[0, 3], n_layers=4, theta_accept=0.9, theta_slim=0.3, budget=0.01,
                                   heldout_fidelity=0.99), tmp_path / "profile.json")
    # The target as its own draft: every drafted token is accepted. A random tiny model is never
    # confident, so the confidence stop rule is off here (it would cut the blocks short).
    r = run(*tiny_args(tiny_dirs, prompt_file, "--methods", "ar,sd,exact,viasd", "--profile", profile, "--json",
                       "--warmup", "0", "-q", "--min-confidence", "0", draft=tiny_dirs["target"]))
    assert r.exit_code == 0, r.stderr
    assert r.stderr == ""
    s = json.loads(r.stdout)  # --json: the summary alone on stdout
    assert {m: s["methods"][m]["status"] for m in ("ar", "sd", "exact", "viasd")} == dict.fromkeys(("ar", "sd", "exact", "viasd"), "ok")
    assert s["methods"]["exact"]["fidelity_min"] == 1.0 and s["methods"]["sd"]["fidelity_min"] == 1.0
    assert s["methods"]["sd"]["acceptance_rate"] == 1.0 and s["methods"]["sd"]["mean_accepted_length"] > 1.5
    assert 0.0 <= s["methods"]["viasd"]["fidelity_min"] <= s["methods"]["viasd"]["fidelity_mean"] <= 1.0
    assert s["meta"]["profile"]["layer_ids"] == [0, 3]


def test_failing_method_is_reported_failed(tiny_dirs, viasd_home, prompt_file, tmp_path, monkeypatch):
    original = core.make_runners

    class Broken:
        def reset(self):
            pass

        def __call__(self, prompt_ids):
            raise RuntimeError("boom")

    def make_runners(session, config, **kw):
        runners = original(session, config, **kw)
        runners["sd"] = Broken()
        return runners

    monkeypatch.setattr(core, "make_runners", make_runners)
    out = tmp_path / "run"
    r = run(*tiny_args(tiny_dirs, prompt_file, "--methods", "ar,sd", "--out", out, "--warmup", "0"))
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    sd = [row for row in rows if row["method"] == "sd"]
    assert len(sd) == 1 and sd[0]["status"] == "failed" and sd[0]["reason"] == "RuntimeError: boom"
    assert sd[0]["tokens_per_s"] is None and sd[0]["fidelity"] is None  # never written as a result
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["sd"] == {"status": "failed", "reason": "RuntimeError: boom", "runs": 0}
    assert summary["methods"]["ar"]["status"] == "ok" and len(ok_rows(rows, "ar")) == 2
    assert "failed: RuntimeError: boom" in r.stdout


def test_methods_take_turns_on_each_prompt_and_a_late_failure_drops_only_its_method(tiny_dirs, viasd_home,
                                                                                  prompt_file, tmp_path, monkeypatch):
    """Prompt by prompt, every method runs in turn (a drifting machine weighs on all alike); a method
    that fails on its second prompt is reported failed, its first row dropped, and the others go on."""
    original = core.make_runners
    calls = []

    class Recorded:
        def __init__(self, name, inner, fail_on=None):
            self.name, self.inner, self.fail_on, self.runs = name, inner, fail_on, 0

        def reset(self):
            self.inner.reset()

        def __call__(self, prompt_ids):
            self.runs += 1
            calls.append(self.name)
            if self.runs == self.fail_on:
                raise RuntimeError("late")
            return self.inner(prompt_ids)

    def make_runners(session, config, **kw):
        runners = original(session, config, **kw)
        recorded = {m: Recorded(m, r, fail_on=2 if m == "sd" else None) for m, r in runners.items()}
        recorded["hf"].build = "CPU : AVX2 = 1"  # a runner that says what it runs (llama.cpp's build line)
        return recorded

    monkeypatch.setattr(core, "make_runners", make_runners)
    out = tmp_path / "run"
    r = run(*tiny_args(tiny_dirs, prompt_file, "--methods", "ar,hf,sd", "--out", out, "--warmup", "0", "--repeats", "2"))
    assert r.exit_code == 0, r.stderr
    # prompt 81 repeat 0: ar, hf, sd; repeat 1: ar, hf, sd (its 2nd run fails); prompt 82: ar, hf twice
    assert calls == ["ar", "hf", "sd", "ar", "hf", "sd", "ar", "hf", "ar", "hf"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [row["method"] for row in rows] == ["ar"] * 4 + ["hf"] * 4 + ["sd"]  # grouped by method in the file
    assert rows[-1]["status"] == "failed" and rows[-1]["reason"] == "RuntimeError: late"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["sd"]["status"] == "failed" and summary["methods"]["hf"]["runs"] == 4
    assert summary["methods"]["hf"]["build"] == "CPU : AVX2 = 1" and "build" not in summary["methods"]["ar"]


def test_ngram_draft_skips_hf_assisted_and_bad_options(tiny_dirs, viasd_home, prompt_file):
    r = run(*tiny_args(tiny_dirs, prompt_file, "--methods", "hf-assisted", "--json", "-q", draft="ngram"))
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)["methods"]["hf-assisted"]
    assert s["status"] == "skipped" and "hf-pld" in s["reason"]
    for args, message in ((("--methods", "ar,fast"), "unknown method 'fast'"), (("--repeats", "0"), "--repeats must be"),
                          (("--acceptance-from", "x.json"), "only apply with --synthetic")):
        r = run(*tiny_args(tiny_dirs, prompt_file, *args))
        assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1 and r.stdout == ""


def test_reduced_vocab_draft_as_transformers_assistant():
    from viasd_core.loading.draft_model import build_draft, draft_llama_config

    target = tiny_model("llama", n_layers=2, seed=5)
    torch.manual_seed(6)
    vocab_map = torch.randperm(256)[:100].sort().values
    draft = build_draft(draft_llama_config(target.config, 1), 100, target.get_input_embeddings()).eval()
    draft.viasd_vocab_map = vocab_map
    head = draft.lm_head
    assistant = runners.full_vocab_assistant(draft, target)
    assert assistant is not draft and draft.lm_head is head and draft.config.vocab_size == 256  # draft untouched
    assert assistant.model is draft.model  # shared decoder, no copy
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        full = assistant(ids).logits
        small = draft(ids).logits
    assert full.shape[-1] == 256 and torch.equal(full[..., vocab_map], small)
    others = torch.ones(256, dtype=torch.bool)
    others[vocab_map] = False
    assert torch.isinf(full[..., others]).all()
    # Assisted greedy generation with the wrapped draft equals plain greedy generation.
    assert assistant.generation_config is not draft.generation_config  # transformers adapts it in place
    plain = runners.HFRunner(target, {2}, 12, 0)([5, 9, 11, 5, 9])
    runner = runners.HFRunner(target, {2}, 12, 0, assistant=assistant, gamma=3)
    runner.reset()
    assisted = runner([5, 9, 11, 5, 9])
    assert assisted.tokens == plain.tokens and plain.target_passes == len(plain.tokens)
    assert sum(assisted.accepted_lengths) == len(assisted.tokens)
    # A draft of the target's vocabulary is its own assistant, with a generation config of its own
    same = tiny_model("llama", n_layers=1, seed=7)
    config_before = same.generation_config
    assert runners.full_vocab_assistant(same, target) is same and same.generation_config is not config_before


def test_hf_accepted_lengths_from_cache_lengths():
    assert runners.hf_accepted_lengths(5, 4, [0, 5, 6, 7]) == [1, 1, 1, 1]  # greedy: one token per pass
    assert runners.hf_accepted_lengths(5, 6, [0, 7, 8]) == [3, 1, 2]  # assisted: prefill + 2 kept + bonus ...
    assert runners.hf_accepted_lengths(5, 6, [0, None]) == []
    assert runners.hf_accepted_lengths(5, 1, []) == []
    assert core.parse_methods("sd, ar,sd") == ["sd", "ar"] and core.parse_methods(None) == list(core.METHODS)


# ---------------------------------------------------------------------- synthetic projection
def test_projection_maths_on_hand_made_numbers():
    assert syn.expected_tokens_per_pass(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert syn.expected_tokens_per_pass(0.0, 5) == 1.0
    assert syn.expected_tokens_per_pass(1.0, 4) == 5.0
    assert syn.expected_tokens_per_pass(0.8, 4) == pytest.approx(sum(0.8 ** k for k in range(5)))
    with pytest.raises(ValueError):
        syn.expected_tokens_per_pass(1.2, 3)
    # Flat target cost, no slim, target every step: docs/algorithm.md's E / (1 + g c), c = 1 / 10
    e = syn.expected_tokens_per_pass(0.7, 4)
    flat = {"draft_step": 1.0, "slim_block": 6.0, "target": {str(t): 10.0 for t in range(1, 6)}}
    flat_sd = syn.project(flat, 4, {m: syn.Assumption(0.7, "t") for m in syn.PROJECTED_METHODS})["sd"]
    assert flat_sd["speedup_vs_ar"] == pytest.approx(e / 1.4) and flat_sd["step_s"] == pytest.approx(14.0)
    assert syn.step_time(4, 1.0, 12.0, 6.0, slim_passes=1, full_fraction=0.5) == pytest.approx(4 + 6 + 6)
    costs = {"draft_step": 1.0, "slim_block": 6.0, "target": {"1": 10.0, "2": 10.5, "3": 11.0, "4": 11.5, "5": 12.0}}
    assume = {"sd": syn.Assumption(0.5, "t"), "exact": syn.Assumption(0.5, "t"), "viasd": syn.Assumption(0.5, "t", 0.5)}
    p = syn.project(costs, 4, assume)
    e = syn.expected_tokens_per_pass(0.5, 4)  # 1.9375
    assert p["ar"]["speedup_vs_ar"] == 1.0
    assert p["sd"]["speedup_vs_ar"] == pytest.approx(e * 10 / (4 + 12))
    assert p["exact"]["speedup_vs_ar"] == pytest.approx(e * 10 / (4 + 6 + 12))
    assert p["viasd"]["speedup_vs_ar"] == pytest.approx(e * 10 / (4 + 6 + 6))
    assert p["sd"]["tokens_per_s"] == pytest.approx(e / 16)
    kept = syn.slim_layer_ids(20, 0.45)
    assert kept[0] == 0 and kept[-1] == 19 and len(kept) == 11 and kept == sorted(set(kept))
    assert syn.slim_layer_ids(2, 0.45) == [0, 1]


def test_acceptance_from_summary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"meta": {"label": "measurement"}, "methods": {
        "sd": {"status": "ok", "acceptance_rate": 0.6, "mean_accepted_length": 2.1},
        "viasd": {"status": "ok", "acceptance_rate": 0.85, "target_passes_per_step": 0.4},
        "exact": {"status": "skipped", "acceptance_rate": None}}}))
    a = syn.acceptance_from_summary(path)
    assert (a["sd"].acceptance, a["sd"].source, a["sd"].measured_mean_accepted_length) == (0.6, str(path), 2.1)
    assert (a["viasd"].acceptance, a["viasd"].full_fraction) == (0.85, 0.4)
    assert a["exact"].acceptance == syn.DEFAULT_ACCEPTANCE["exact"] and "default" in a["exact"].source
    path.write_text(json.dumps({"meta": {"label": "projection"}, "methods": {}}))
    with pytest.raises(syn.UsageError, match="itself a projection"):
        syn.acceptance_from_summary(path)


def test_synthetic_cli_is_labelled_a_projection(viasd_home, tmp_path, monkeypatch):
    monkeypatch.setattr(syn, "DEFAULT_REPS", 3)  # a loaded CI machine: the numbers are not the point here
    monkeypatch.setattr(syn, "DEFAULT_CONTEXT", 16)
    r = run("--synthetic", "tiny", "--device", "cpu", "--gamma", "3", "-q", "--out", tmp_path / "syn")
    assert r.exit_code == 0, r.stderr
    assert "PROJECTION" in r.stdout and r.stderr == ""
    s = json.loads((tmp_path / "syn" / "summary.json").read_text())
    assert s["meta"]["label"] == "projection" and s["projection"]["label"] == "projection"
    p = s["projection"]
    assert set(p["costs_s"]["target"]) == {"1", "2", "3", "4"} and p["costs_s"]["draft_step"] > 0
    assert p["costs_s"]["reps"] == 3 and p["costs_s"]["context"] == 16
    assert any("PROJECTION" in line for line in p["assumptions"])
    for m in ("sd", "exact", "viasd"):
        row = p["projection"][m]
        assert math.isfinite(row["speedup_vs_ar"]) and row["speedup_vs_ar"] > 0
        assert row["acceptance"] == syn.DEFAULT_ACCEPTANCE[m] and "default" in row["acceptance_source"]
    big = run("--synthetic", "llama-3-8b", "--device", "cpu")
    assert big.exit_code == 2 and "--force" in big.stderr and big.stdout == ""
    unknown = run("--synthetic", "gpt-5", "--device", "cpu")
    assert unknown.exit_code == 2 and "unknown --synthetic shape" in unknown.stderr


def test_eos_and_pad_ids_one_rule():
    from types import SimpleNamespace

    from viasd_core.loading.models import eos_ids, pad_token_id

    def loaded(model_eos, tok_eos, tok_pad):
        model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=model_eos))
        return SimpleNamespace(model=model, tokenizer=SimpleNamespace(eos_token_id=tok_eos, pad_token_id=tok_pad))

    assert eos_ids(loaded([7, 5], 9, None)) == {5, 7, 9} and pad_token_id(loaded([7, 5], 9, None)) == 5
    assert eos_ids(loaded(3, None, 0)) == {3} and pad_token_id(loaded(3, None, 0)) == 0  # pad 0 is a pad
    assert eos_ids(loaded(None, None, None)) == set() and pad_token_id(loaded(None, None, None)) == 0


def test_sd_starts_at_the_measured_block_and_the_probe_speaks_through_the_log(tiny_dirs, viasd_home, prompt_file):
    """Without -g, bench's sd starts where `viasd generate` would (the --tree auto probe's fastest
    chain, cached): the meta says which and why; the probe's progress line goes through the log,
    which -q silences, and is not printed again once cached."""
    args = tiny_args(tiny_dirs, prompt_file, "--methods", "ar,sd,sd-tree", "--json", "--warmup", "0")
    loud = run(*args)
    assert loud.exit_code == 0, loud.stderr
    assert loud.stderr.count("measuring this machine's verify costs") == 1
    meta = json.loads(loud.stdout)["meta"]
    assert meta["gamma"] is None and 2 <= meta["first_block"]["gamma"] <= 5
    assert "fastest chain" in meta["first_block"]["reason"]
    for path in (viasd_home / "cache" / "machine").glob("tree-*.json"):
        path.unlink()  # measured again below, under -q
    quiet = run(*args, "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    given = json.loads(run(*args, "-q", "--gamma", "4").stdout)["meta"]
    assert given["gamma"] == 4


def test_the_meta_says_which_instruction_set_class_ran_and_the_cap(monkeypatch):
    """A capped run (VIASD_MAX_CPU_ISA) is told from a native one by its summary alone."""
    import torch
    from viasd_kernels import instruction_set

    from viasd_core.bench.files import make_meta

    monkeypatch.setenv(instruction_set.ISA_ENV, "avx2")
    said = make_meta(torch.device("cpu"))["instruction_set"]
    assert said.startswith(instruction_set.isa_class() + ":") and f"{instruction_set.ISA_ENV}=avx2" in said
    monkeypatch.delenv(instruction_set.ISA_ENV)
    assert make_meta(torch.device("cpu"))["instruction_set"] == instruction_set.describe_isa()
    assert "VIASD_MAX_CPU_ISA" not in make_meta(torch.device("cpu"))["instruction_set"]
    assert make_meta(torch.device("meta"))["instruction_set"] is None  # not a CPU run
