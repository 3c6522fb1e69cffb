"""`viasd distill` through the real Typer app on a tiny target: the recipe runs end to end, bad
options are one-line usage errors before any model is loaded, and only families viasd runs
(model.SUPPORTED_FAMILIES) whose layers fit a Llama draft are distilled."""

import json

import pytest
from typer.testing import CliRunner

from conftest import save_tiny_model_dir
from viasd_cli.app import get_app
from viasd_core.runtime.families import SUPPORTED_FAMILIES

PROMPTS = ["w1 w2 w3 w4", "w5 w6 w7", "w8 w9 w10 w11 w12", "w13 w14", "w15 w16 w17"]


def run(*args):
    return CliRunner().invoke(get_app(), ["distill", *map(str, args)])


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "category": "c"}) + "\n" for p in PROMPTS))
    return path


def one_line_error(r, code, message):
    assert r.exit_code == code, (r.exit_code, r.stderr)
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert r.stdout == ""


def test_recipe_end_to_end(tiny_dirs, viasd_home, prompt_file, tmp_path):
    from viasd_core.loading.draft_model import load_draft, read_draft_config
    from viasd_core.loading.models import load_model

    out = tmp_path / "draft"
    r = run("--target", tiny_dirs["target"], "--out", out, "--prompts", prompt_file, "--eval-prompts", prompt_file,
            "--eval-limit", "2", "--layers", "1", "--draft-vocab", "16", "--steps", "4", "--batch-size", "2",
            "--max-new-tokens", "4", "--fp32", "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"{out}\n"  # the folder alone on stdout, progress on stderr
    assert "greedy: 5/5 prompts" in r.stderr and "sampled: 2/2 prompts" in r.stderr
    training = read_draft_config(out)["training"]
    # prompt 0 is held out (index % 20 == 0); sampled continuations for prompts 1 and 3 (every 2nd, from the 2nd)
    assert training["held_out"]["sequences"] == 1 and training["held_out"]["rule"] == "prompt index % 20 == 0"
    assert training["records"] == 4 + 2 and training["sampled_every"] == 2 and training["sampled_temperature"] == 0.8
    assert training["steps"] == 4 and training["layers_from_target"] == [0]
    assert (training["batch_size"], training["lr"], training["warmup"], training["weight_decay"]) == (2, 1e-3, 30, 0.1)
    assert training["bf16_autocast"] is False and training["prompts"] == str(prompt_file)
    assert training["eval"]["prompts"] == 2 and training["eval"]["file"] == str(prompt_file)
    assert 0.0 <= training["eval"]["agreement"] <= 1.0 and training["eval"]["tokens"] >= 2
    target = load_model(str(tiny_dirs["target"]), device="cpu")
    draft = load_draft(out, target.model, tokenizer=target.tokenizer)
    assert draft.viasd_vocab_map.numel() == 16 and len(draft.model.layers) == 1


def test_feature_head_recipe_end_to_end_and_resumes_from_its_work_folder(tiny_dirs, viasd_home, prompt_file, tmp_path):
    from viasd_core.speculation.eagle_files import read_head_config

    out, work = tmp_path / "head", tmp_path / "work"
    args = ("--kind", "feature", "--target", tiny_dirs["target"], "--out", out, "--work", work, "--prompts", prompt_file,
            "--eval-prompts", prompt_file, "--eval-limit", "2", "--draft-vocab", "32", "--steps", "4", "--batch-size", "2",
            "--max-new-tokens", "6", "--fp32", "--device", "cpu", "--threads", "1")
    r = run(*args)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"{out}\n"
    assert "greedy: 5/5 prompts" in r.stderr and "sampled: 5/5 prompts" in r.stderr
    cfg = read_head_config(out)
    info = cfg["viasd_training"]
    assert cfg["draft_vocab_size"] == 32 and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # 4-layer target
    assert info["sequences"] == 4 + 4 and info["held_out_sequences"] == 1  # prompt 0 held out (greedy answer kept)
    assert info["train"]["steps"] == 4 and len(info["eval"]["agreement_by_position"]) == 8
    assert sorted(p.name for p in work.iterdir()) == ["eval.pt", "features-eval.pt", "features-greedy.pt",
                                                      "features-sampled.pt", "greedy.pt", "head.ckpt", "sampled.pt"]
    # The head is a draft for generation, token-identical to plain decoding.
    texts = {}
    for mode in ("ar", "sd"):
        g = CliRunner().invoke(get_app(), ["generate", "w1 w2 w3", "-m", str(tiny_dirs["target"]), "-d", str(out), "-n", "8",
                                           "--mode", mode, "-q"])
        assert g.exit_code == 0, g.stderr
        texts[mode] = g.stdout
    assert texts["sd"] == texts["ar"]
    # The same command again: every stage is cached, training is already at its last step.
    again = run(*args)
    assert again.exit_code == 0, again.stderr
    assert "greedy.pt: cached" in again.stderr and "features-sampled.pt: cached" in again.stderr
    assert "resumed at step 4" in again.stderr and "greedy: 1/5" not in again.stderr


def test_feature_kind_needs_a_work_folder(tiny_dirs, viasd_home, tmp_path):
    one_line_error(run("--kind", "feature", "--target", tiny_dirs["target"], "--out", tmp_path / "h"), 2,
                   "--kind feature needs --work FOLDER")
    one_line_error(run("--kind", "tree", "--target", tiny_dirs["target"], "--out", tmp_path / "h"), 2, "unknown --kind 'tree'")


@pytest.mark.parametrize("args, message", [
    (("--batch-size", "0"), "--batch-size must be at least 1 (got 0)"),
    (("--lr", "0"), "--lr must be > 0 (got 0.0)"),
    (("--sampled-every", "-1"), "--sampled-every must be at least 0 (got -1)"),
    (("--eval-limit", "0"), "--eval-limit must be at least 1 (got 0)"),
    (("--time-limit", "0"), "--time-limit must be > 0 (got 0.0)"),
    (("--draft-vocab", "8"), "--draft-vocab must be at least 16 (got 8)"),
    (("--eval-prompts", "missing.jsonl"), "prompt file 'missing.jsonl' not found"),
])
def test_bad_options_are_usage_errors_before_loading(viasd_home, prompt_file, tmp_path, args, message):
    # the target does not exist: a check that ran after loading it would report that instead
    r = run("--target", tmp_path / "no-model", "--out", tmp_path / "d", "--prompts", prompt_file, *args)
    one_line_error(r, 2, message)


def test_too_few_prompts_to_train_on(tiny_dirs, viasd_home, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    one_line_error(run("--target", tiny_dirs["target"], "--out", tmp_path / "d", "--prompts", one), 2, "all held out")


def test_family_check_is_the_engines(viasd_home, prompt_file, tmp_path):
    # SmolLM3: Llama-shaped layers, but viasd cannot run it: no draft is made for it
    smollm3 = save_tiny_model_dir(tmp_path / "smollm3", family="smollm3", n_layers=2)
    one_line_error(run("--target", smollm3, "--out", tmp_path / "d", "--prompts", prompt_file, "--steps", "1"), 1,
                   f"model family 'smollm3' is not supported yet (supported: {', '.join(SUPPORTED_FAMILIES)})")
    # Qwen2 runs in viasd, but its attention biases do not fit a Llama draft layer
    qwen2 = save_tiny_model_dir(tmp_path / "qwen2", family="qwen2", n_layers=2)
    one_line_error(run("--target", qwen2, "--out", tmp_path / "d", "--prompts", prompt_file, "--steps", "1"), 1,
                   "qwen2 layers do not fit (extra weights ['self_attn.k_proj.bias'")
    assert not (tmp_path / "d").exists()
