"""`--draft auto` (loading/draft_choice.py): every catalog pair of the target and every cached head are
looked at, the best here is picked (a head over a draft model over prompt lookup) and --verbose says
which and why; a head is looked up at its own revision, never the target's --revision."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.conftest_hub import commit_of, hub_env, put_in_cache  # noqa: F401  (fixtures)
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.loading.draft_choice import choose_draft

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_DRAFT = "meta-llama/Llama-3.2-1B-Instruct"
LLAMA_HEAD = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


def folder_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def head_files(tiny_dirs, tmp_path_factory):
    """An EAGLE-3 head for the tiny target, in the published layout, as repo files."""
    from transformers import AutoModelForCausalLM

    from viasd_core.speculation.eagle_files import save_feature_head
    from viasd_core.training import eagle_init

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"])
    head = eagle_init.init_head(target, (0, 1, 2), torch.arange(0, 256, 2), seed=1)
    return folder_files(save_feature_head(head, tmp_path_factory.mktemp("heads") / "head"))


@pytest.fixture
def tiny_target(tiny_dirs):
    """A stand-in for a loaded target: the catalog's Llama-3.1-8B id over the tiny target's config."""
    from transformers import AutoConfig

    return SimpleNamespace(model_id=LLAMA, model=SimpleNamespace(config=AutoConfig.from_pretrained(tiny_dirs["target"])))


def test_auto_looks_at_every_catalog_pair_and_ranks_a_head_first(hub_env, tiny_dirs, head_files, tiny_target):
    model_files = folder_files(tiny_dirs["draft"])
    choice = choose_draft(tiny_target)
    assert choice.ref == "ngram"
    assert "not pulled: llama3.1-8b-eagle3, llama3.1-8b;" in choice.reason  # both pairs named
    # only the second pair's head is pulled: it is found (the first pair's draft model is not cached)
    put_in_cache(hub_env.cache, LLAMA_HEAD, head_files, commit_of("head"))
    choice = choose_draft(tiny_target)
    assert choice.ref == LLAMA_HEAD and "published EAGLE-3 head of catalog pair llama3.1-8b-eagle3" in choice.reason
    # both pulled: the head still ranks above the draft model
    put_in_cache(hub_env.cache, LLAMA_DRAFT, model_files, commit_of("draft"))
    assert choose_draft(tiny_target).ref == LLAMA_HEAD


def test_auto_takes_a_cached_head_that_fits_over_a_catalog_draft_model(hub_env, tiny_dirs, head_files, tiny_target):
    put_in_cache(hub_env.cache, LLAMA_DRAFT, folder_files(tiny_dirs["draft"]), commit_of("draft"))
    choice = choose_draft(tiny_target)
    assert choice.ref == LLAMA_DRAFT and "draft model of catalog pair llama3.1-8b" in choice.reason
    assert "not cached: llama3.1-8b-eagle3" in choice.reason
    put_in_cache(hub_env.cache, "someone/tiny-eagle3", head_files, commit_of("other head"))
    choice = choose_draft(tiny_target)
    assert choice.ref == "someone/tiny-eagle3" and "whose shapes fit the target" in choice.reason
    # a head whose shapes do not fit this target is passed over
    misfit = dict(head_files)
    config = json.loads(misfit["config.json"])
    misfit["config.json"] = json.dumps(config | {"vocab_size": 999}).encode()
    put_in_cache(hub_env.cache, "aaa/misfit-eagle3", misfit, commit_of("misfit"))
    assert choose_draft(tiny_target).ref == "someone/tiny-eagle3"


def test_generate_auto_says_which_draft_and_why_and_a_head_ignores_the_targets_revision(hub_env, tiny_dirs, head_files):
    # the target is cached only at its tag v1, the head only at main
    put_in_cache(hub_env.cache, "org/tiny", folder_files(tiny_dirs["target"]), commit_of("target v1"), refs=("v1",))
    put_in_cache(hub_env.cache, "org/tiny-eagle3", head_files, commit_of("head main"))

    def run(*args):
        r = CliRunner().invoke(get_app(), ["generate", "w1 w2 w3 w4", "-m", "org/tiny", "--revision", "v1", "-n", "8",
                                           "--json", "--threads", "1", "--tree", "off", *args])
        assert r.exit_code == 0, r.stderr
        return r, json.loads(r.stdout)

    r, auto = run("--verbose")
    assert auto["draft"] == "org/tiny-eagle3" and auto["stats"]["draft_tokens"] > 0
    assert "draft: org/tiny-eagle3 (an EAGLE-3 head in the cache whose shapes fit the target" in r.stderr
    _, named = run("-d", "org/tiny-eagle3")  # named: looked up at main, not at the target's v1
    _, ar = run("--mode", "ar")
    assert named["text"] == auto["text"] == ar["text"]


# ---------------------------------------------------------------------- Qwen3 (issue 50 part 4)
QWEN3, QWEN3_DRAFT = "Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"
ANGELSLIM_HEAD, TENGYUNW_HEAD = "AngelSlim/Qwen3-8B_eagle3", "Tengyunw/qwen3_8b_eagle3"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 target of 8 layers (the heads' default feature layers: 2, 4, 5), with a tokenizer."""
    from conftest import save_tiny_model_dir

    return save_tiny_model_dir(tmp_path_factory.mktemp("qwen3") / "target", family="qwen3", n_layers=8, seed=41)


def test_auto_picks_a_cached_published_head_for_a_qwen3_target(hub_env, qwen3_dir):
    from transformers import AutoConfig

    from support.qwen3_head_files import published_files

    target = SimpleNamespace(model_id=QWEN3, model=SimpleNamespace(config=AutoConfig.from_pretrained(qwen3_dir)))
    choice = choose_draft(target)
    assert choice.ref == "ngram"
    assert "not pulled: qwen3-8b-eagle3, qwen3-8b-eagle3-tengyunw, qwen3-8b;" in choice.reason
    put_in_cache(hub_env.cache, QWEN3_DRAFT, folder_files(qwen3_dir), commit_of("qwen3 draft"))
    assert choose_draft(target).ref == QWEN3_DRAFT
    # a head over the draft model; of two catalog heads, the first pair's
    put_in_cache(hub_env.cache, TENGYUNW_HEAD, published_files(seed=1), commit_of("tengyunw"))
    choice = choose_draft(target)
    assert choice.ref == TENGYUNW_HEAD and "catalog pair qwen3-8b-eagle3-tengyunw" in choice.reason
    put_in_cache(hub_env.cache, ANGELSLIM_HEAD, published_files(seed=2), commit_of("angelslim"))
    choice = choose_draft(target)
    assert choice.ref == ANGELSLIM_HEAD and "catalog pair qwen3-8b-eagle3," in choice.reason


def test_generate_on_a_qwen3_target_drafts_with_the_cached_head_and_keeps_ars_text(hub_env, qwen3_dir):
    from support.qwen3_head_files import published_files

    put_in_cache(hub_env.cache, QWEN3, folder_files(qwen3_dir), commit_of("qwen3"))
    put_in_cache(hub_env.cache, ANGELSLIM_HEAD, published_files(seed=3), commit_of("angelslim"))

    def run(*args):
        r = CliRunner().invoke(get_app(), ["generate", "w1 w2 w3 w4 w1 w2", "-m", QWEN3, "-n", "12", "--json",
                                           "--threads", "1", "--tree", "off", *args])
        assert r.exit_code == 0, r.stderr
        return r, json.loads(r.stdout)

    r, auto = run("--verbose")
    assert auto["draft"] == ANGELSLIM_HEAD and auto["stats"]["draft_tokens"] > 0
    assert f"draft: {ANGELSLIM_HEAD} (the published EAGLE-3 head of catalog pair qwen3-8b-eagle3" in r.stderr
    _, ar = run("--mode", "ar")
    assert auto["text"] == ar["text"]
