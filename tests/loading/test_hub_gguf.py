"""A GGUF file of a hub repo as a model (`-m org/name:QUANT`, `-m org/name/FILE.gguf`, `viasd pull`
of the same), against a fake Hub and a temporary HF cache (tests/support/conftest_hub.py, never the network),
with tiny GGUF files written by tests/support/gguf_tiny.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.conftest_hub import FakeHub, commit_of, fake_hub, hub_env, repo_folder  # noqa: F401  (fixtures)
from support.cli_cases import one_line_error
from support.gguf_tiny import CHAT, write_tiny_gguf
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.errors import ViasdError
from viasd_core.loading import gguf_refs
from viasd_core.loading.gguf_refs import HubGguf

PROMPT = "hello world"
REPO = "org/tiny-GGUF"
GEN = ("--mode", "ar", "-n", "6", "--json", "--threads", "1")


def run(*args):
    return CliRunner().invoke(get_app(), [*map(str, args)])


@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    """Two tiny Llamas as GGUF files on disk: Q4_0 and Q4_1 blocks (different seeds: different models)."""
    import gguf

    folder = tmp_path_factory.mktemp("gguf-local")
    files = {"Q4_0": folder / "tiny-Q4_0.gguf", "Q4_1": folder / "tiny-Q4_1.gguf"}
    write_tiny_gguf(files["Q4_0"], seed=3, qtype=gguf.GGMLQuantizationType.Q4_0)
    write_tiny_gguf(files["Q4_1"], seed=5, qtype=gguf.GGMLQuantizationType.Q4_1)
    return files


@pytest.fixture
def repo(fake_hub, local_files):
    """A GGUF repo on the fake Hub, laid out as bartowski's: one file a quantization (one in a
    folder), a vision projector, a README; `Q4_0_4_4` holds the Q4_0 tag but not as a whole part."""
    q4_0, q4_1 = local_files["Q4_0"].read_bytes(), local_files["Q4_1"].read_bytes()
    fake_hub.add(REPO, {
        "tiny-Q4_0.gguf": q4_0,
        "tiny-Q4_0_4_4.gguf": q4_1,
        "more/tiny-Q4_1.gguf": q4_1,
        "mmproj-tiny-Q4_0-f16.gguf": b"GGUF not a language model",
        "README.md": b"# tiny",
    })
    return fake_hub


def gguf_downloads(hub: FakeHub) -> list[str]:
    return [name for _, name, _ in hub.downloads]


def generated(r) -> dict:
    assert r.exit_code == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["new_tokens"] >= 1
    return row


# ---------------------------------------------------------------------- spellings
@pytest.mark.parametrize("ref, parsed", [
    ("bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", HubGguf("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M", None)),
    ("hf.co/org/name:q8_0", HubGguf("org/name", "q8_0", None)),  # Ollama's spelling
    ("org/name/model-Q4_0.gguf", HubGguf("org/name", None, "model-Q4_0.gguf")),
    ("org/name/sub/dir/model.GGUF", HubGguf("org/name", None, "sub/dir/model.GGUF")),
    ("org/name", None),  # a transformers repo
    ("org/name/model.bin", None),
    ("org/name:", None),
    ("./org/x.gguf", None),  # not a repo id
    ("smollm2-135m", None),
    ("org/na..me:Q4_0", None),
])
def test_the_accepted_spellings(ref, parsed):
    assert gguf_refs.parse(ref) == parsed


def test_a_local_path_is_never_a_hub_reference(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert gguf_refs.parse("org/name/m.gguf") is None
    assert gguf_refs.parse("org/name/other.gguf") == HubGguf("org/name", None, "other.gguf")


def test_a_tag_picks_one_file_or_names_the_choices():
    names = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q4_0.gguf", "m-Q4_0_4_4.gguf", "mmproj-m-Q4_0.gguf", "sub/m-Q8_0.gguf", "README.md"]
    pick = lambda tag: gguf_refs.pick(HubGguf("o/m", tag, None), names, "")  # noqa: E731
    assert pick("q4_k_m") == "m-Q4_K_M.gguf"  # case-insensitive
    assert pick("Q4_0") == "m-Q4_0.gguf"  # a whole part of the name wins over Q4_0_4_4; mmproj never picked
    assert pick("Q8_0") == "sub/m-Q8_0.gguf"  # in a folder
    with pytest.raises(ViasdError, match=r"^the tag Q4_K matches 2 \.gguf files of o/m: m-Q4_K_M\.gguf, m-Q4_K_S\.gguf; "
                                         r"give a longer tag, or the file as o/m/FILE\.gguf$"):
        pick("Q4_K")
    with pytest.raises(ViasdError, match=r"^no \.gguf file of o/m matches the tag Q6_K; its \.gguf files: m-Q4_0\.gguf, "):
        pick("Q6_K")


# ---------------------------------------------------------------------- -m org/name:QUANT
def test_a_repo_and_tag_downloads_that_file_and_runs_as_the_local_file(repo, local_files):
    hub_run = generated(run("generate", PROMPT, "-m", f"{REPO}:q4_0", *GEN))
    assert gguf_downloads(repo) == ["tiny-Q4_0.gguf"]  # that file only
    local_run = generated(run("generate", PROMPT, "-m", local_files["Q4_0"], *GEN, "-q"))
    assert (hub_run["text"], hub_run["new_tokens"]) == (local_run["text"], local_run["new_tokens"])
    assert hub_run["model"] == local_run["model"] == "tiny-Q4_0"  # the file's name, as for a local file
    other = generated(run("generate", PROMPT, "-m", local_files["Q4_1"], *GEN, "-q"))
    assert other["text"] != hub_run["text"]  # the two files differ: the comparison can fail
    calls = (len(repo.info_calls), len(repo.downloads))
    again = generated(run("generate", PROMPT, "-m", f"{REPO}:Q4_0", *GEN, "-q"))
    assert again["text"] == hub_run["text"]
    assert (len(repo.info_calls), len(repo.downloads)) == calls  # cached: no Hub call at all


def test_quant_gguf_runs_the_hub_files_own_blocks(repo, local_files):
    hub_run = generated(run("generate", PROMPT, "-m", f"{REPO}:Q4_0", "--quant", "gguf", *GEN, "-q"))
    local_run = generated(run("generate", PROMPT, "-m", local_files["Q4_0"], "--quant", "gguf", *GEN, "-q"))
    assert hub_run["text"] == local_run["text"]
    r = run("generate", PROMPT, "-m", f"{REPO}:Q4_0", "--quant", "gguf", "--verbose", *GEN)
    assert r.exit_code == 0, r.stderr
    assert "the file's Q4_0 blocks as int4" in r.stderr, r.stderr


def test_the_tokenizer_and_chat_template_come_from_the_file(repo):
    from viasd_core.loading.models import load_model

    loaded = load_model(f"{REPO}:Q4_0", device="cpu", dtype="float32")
    assert loaded.ref == f"{REPO}:Q4_0" and loaded.model_id == "tiny-Q4_0"
    assert loaded.tokenizer.chat_template == CHAT
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(PROMPT)) == PROMPT


def test_a_repo_and_file_path_runs_that_file(repo, local_files):
    hub_run = generated(run("generate", PROMPT, "-m", f"{REPO}/more/tiny-Q4_1.gguf", *GEN, "-q"))
    assert gguf_downloads(repo) == ["more/tiny-Q4_1.gguf"]
    local_run = generated(run("generate", PROMPT, "-m", local_files["Q4_1"], *GEN, "-q"))
    assert hub_run["text"] == local_run["text"]


def test_the_revision_picks_that_commits_file(fake_hub, local_files):
    fake_hub.add(REPO, {"tiny-Q4_0.gguf": local_files["Q4_1"].read_bytes()}, commit=commit_of("v1"), refs=("v1",))
    fake_hub.add(REPO, {"tiny-Q4_0.gguf": local_files["Q4_0"].read_bytes()}, commit=commit_of("main"), refs=("main",))
    found = gguf_refs.fetch_gguf(gguf_refs.parse(f"{REPO}:Q4_0"), revision="v1", progress=False)
    assert found.read_bytes() == local_files["Q4_1"].read_bytes()
    assert found.parent.name == commit_of("v1")
    assert (repo_folder(fake_hub.cache, REPO) / "refs" / "v1").read_text() == commit_of("v1")


# ---------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize("ref, message", [
    (f"{REPO}:Q4", f"the tag Q4 matches 3 .gguf files of {REPO}: more/tiny-Q4_1.gguf, tiny-Q4_0.gguf, tiny-Q4_0_4_4.gguf; "
                   f"give a longer tag, or the file as {REPO}/FILE.gguf"),
    (f"{REPO}:Q8_0", f"no .gguf file of {REPO} matches the tag Q8_0; its .gguf files: mmproj-tiny-Q4_0-f16.gguf, "
                     "more/tiny-Q4_1.gguf, tiny-Q4_0.gguf, tiny-Q4_0_4_4.gguf"),
    (f"{REPO}/tiny-Q8_0.gguf", f"{REPO} has no file tiny-Q8_0.gguf; its .gguf files: mmproj-tiny-Q4_0-f16.gguf, "),
    (REPO, f"model {REPO} is a GGUF repo (it has mmproj-tiny-Q4_0-f16.gguf, more/tiny-Q4_1.gguf, tiny-Q4_0.gguf "
           f"and 1 more): name one file, as {REPO}:QUANT (e.g. {REPO}:Q4_K_M) or {REPO}/FILE.gguf"),
    ("org/missing-GGUF:Q4_0", "model org/missing-GGUF was not found on the Hugging Face Hub"),
])
def test_a_tag_or_file_that_does_not_fit_is_one_line_naming_the_choices(repo, ref, message):
    one_line_error(run("generate", PROMPT, "-m", ref), 1, message)
    assert gguf_downloads(repo) == []


def test_offline_and_not_cached_is_one_line_naming_the_reference(hub_env):  # HF_HUB_OFFLINE=1 from hub_env
    one_line_error(run("generate", PROMPT, "-m", f"{REPO}:Q4_0"), 1,
                   f"cannot pull {REPO}:Q4_0: offline mode is on (HF_HUB_OFFLINE=1; unset it to download); "
                   f"pull it on a machine with network access (or copy its models--org--tiny-GGUF folder into")
    one_line_error(run("pull", f"{REPO}/tiny-Q4_0.gguf"), 1, f"cannot pull {REPO}/tiny-Q4_0.gguf: offline mode is on")


def test_offline_a_cached_file_runs(repo, monkeypatch):
    generated(run("generate", PROMPT, "-m", f"{REPO}:Q4_0", *GEN, "-q"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo.connection_down = True
    row = generated(run("generate", PROMPT, "-m", f"{REPO}:Q4_0", *GEN, "-q"))
    assert row["model"] == "tiny-Q4_0"
    r = run("pull", f"{REPO}:Q4_0", "-q")
    assert r.exit_code == 0, r.stderr
    # a tag no cached file fits is not looked up on the Hub when offline
    one_line_error(run("generate", PROMPT, "-m", f"{REPO}:Q4_1"), 1, f"cannot pull {REPO}:Q4_1: offline mode is on")


# ---------------------------------------------------------------------- viasd pull
def test_pull_takes_a_repo_and_tag_and_prints_the_file(repo, local_files):
    r = run("pull", f"{REPO}:Q4_0")
    assert r.exit_code == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.name == "tiny-Q4_0.gguf" and path.read_bytes() == local_files["Q4_0"].read_bytes()
    assert f"{REPO}:Q4_0: downloading tiny-Q4_0.gguf" in r.stderr
    assert gguf_downloads(repo) == ["tiny-Q4_0.gguf"]
    r = run("pull", f"hf.co/{REPO}/tiny-Q4_0.gguf")
    assert r.exit_code == 0 and Path(r.stdout.strip()) == path, r.stderr
    assert "already in the cache" in r.stderr
    assert gguf_downloads(repo) == ["tiny-Q4_0.gguf"]  # listed again, not downloaded again
    one_line_error(run("pull", f"{REPO}:Q4_0", "--draft", "org/other"), 2, "--draft does not apply to a GGUF file")


def test_pull_checks_disk_space_before_downloading(repo, monkeypatch):
    from support.conftest_hub import disk_usage_with_free

    from viasd_core.loading import hub_pull

    monkeypatch.setattr(hub_pull.shutil, "disk_usage", disk_usage_with_free(1000))
    one_line_error(run("pull", f"{REPO}:Q4_0"), 1, f"not enough disk space for {REPO}:Q4_0")
    assert gguf_downloads(repo) == []
