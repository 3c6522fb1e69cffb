"""Limits the set-up chooses are said, not silent: the context cap (session.context_size, through
the progress callback) and a --max-new-tokens clipped to the context (Generation.clipped_to, which
`viasd generate` prints on stderr and puts in its JSON)."""

import json

from typer.testing import CliRunner

from conftest import TinyTokenizer, tiny_model
from viasd_cli.app import get_app
from viasd_core import session as session_module
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.session import DEFAULT_CONTEXT_CAP, context_size

# One position of the tiny llama's three caches: 2 (K, V) x 4 layers x 2 KV heads x 16 dims x 4 bytes x 3
PER_POSITION = 2 * 4 * 2 * 16 * 4 * 3


def said(model, requested=None, free=2**40, monkeypatch=None):
    monkeypatch.setattr(session_module, "free_memory_bytes", lambda device: free)
    lines = []
    size = context_size(model, requested, lines.append)
    return size, lines


def test_the_default_cap_is_said_with_how_to_raise_it(monkeypatch):
    model = tiny_model("llama", max_position_embeddings=8192)
    size, lines = said(model, monkeypatch=monkeypatch)
    assert size == DEFAULT_CONTEXT_CAP == 4096
    assert lines == ["context: 4096 positions (the default cap; the model's own is 8192): raise it with --max-context"]


def test_the_memory_cap_is_said_with_how_to_raise_it(monkeypatch):
    model = tiny_model("llama", max_position_embeddings=8192)
    free = 4 * 1000 * PER_POSITION  # a quarter of it holds 1000 positions
    size, lines = said(model, free=free, monkeypatch=monkeypatch)
    assert size == 1000 and len(lines) == 1
    assert lines[0].startswith("context: 1000 positions (what a quarter of the 12 MiB free on cpu holds; "
                               "the model's own is 8192)") and lines[0].endswith("raise it with --max-context")


def test_nothing_is_said_when_nothing_is_capped(monkeypatch):
    model = tiny_model("llama")  # 512 positions: under the default cap, and memory holds them
    assert said(model, monkeypatch=monkeypatch) == (512, [])
    assert said(tiny_model("llama", max_position_embeddings=8192), requested=64, monkeypatch=monkeypatch) == (64, [])


def test_generation_says_when_max_new_tokens_was_clipped():
    fast = FastModel(tiny_model("llama"), max_len=32)
    engine = Engine(fast, TinyTokenizer(), context_len=32)
    prompt = list(range(8, 28))  # 20 tokens: 12 positions left
    clipped = engine.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=50))
    assert clipped.clipped_to == 12 and len(clipped.tokens) <= 12
    engine.reset()
    kept = engine.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=12))
    assert kept.clipped_to is None and kept.tokens == clipped.tokens


def test_cli_generate_prints_the_clip_on_stderr(tiny_dirs, viasd_home):
    prompt = " ".join(f"w{i}" for i in range(20))
    args = ["generate", prompt, "-m", str(tiny_dirs["target"]), "-d", "ngram", "--raw", "--max-context", "32", "-n", "50"]
    runner = CliRunner()
    text = runner.invoke(get_app(), args)
    assert text.exit_code == 0, text.stderr
    line = "--max-new-tokens 50 clipped to 12: the prompt's 20 tokens fill the rest of the 32-position context (raise --max-context)"
    assert line in text.stderr.splitlines() and "clipped" not in text.stdout
    quiet = runner.invoke(get_app(), args + ["--json", "-q"])
    assert quiet.exit_code == 0 and quiet.stderr.splitlines() == [line]  # said even with --quiet
    record = json.loads(quiet.stdout)
    assert record["clipped_to"] == 12 and record["new_tokens"] <= 12
    fits = runner.invoke(get_app(), args[:-1] + ["8", "--json", "-q"])
    assert fits.exit_code == 0 and fits.stderr == "" and json.loads(fits.stdout)["clipped_to"] is None
