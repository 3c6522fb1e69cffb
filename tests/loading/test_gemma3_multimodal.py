"""Text generation from a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration, model_type
`gemma3`: google/gemma-3-4b-it and the larger ones): viasd loads the checkpoint and runs its language
model (a gemma3_text model) through the gemma3_text path, the vision tower left out.

The checkpoint here is a tiny one (conftest.multimodal_config: a 2-layer gemma3_text language model,
a 1-layer SigLIP vision tower) whose language model and head hold a tiny gemma3_text causal LM's
weights, saved to a folder with a tokenizer: `viasd generate -m FOLDER` in ar and sd emits the tokens
that causal LM alone emits in transformers (and the whole checkpoint's generate() in transformers too).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import multimodal_config, save_tiny_model_dir, tiny_model
from viasd_cli.app import get_app

PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8"
NEW = 16
SAID = "a multimodal gemma3 checkpoint: viasd runs its gemma3_text language model"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder of the multimodal checkpoint, its language model alone as a transformers causal LM,
    folder of a 1-layer gemma3_text draft of the same tokenizer)."""
    from transformers import Gemma3ForConditionalGeneration

    text = tiny_model("gemma3_text", n_layers=2, seed=7)
    torch.manual_seed(0)
    whole = Gemma3ForConditionalGeneration(multimodal_config(n_layers=2)).eval()
    whole.model.language_model.load_state_dict(text.model.state_dict())
    whole.lm_head.load_state_dict(text.lm_head.state_dict())
    base = tmp_path_factory.mktemp("gemma3")
    folder = save_tiny_model_dir(base / "gemma-3-mm", model=whole)
    draft = save_tiny_model_dir(base / "draft", family="gemma3_text", n_layers=1, seed=8)
    return folder, text, whole, draft


def greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(ids):].tolist()


def run(*args):
    return CliRunner().invoke(get_app(), ["generate", *map(str, args)])


def test_generate_runs_the_language_model_of_a_multimodal_checkpoint(checkpoint, viasd_home):
    from transformers import AutoTokenizer

    from viasd_core.loading.prompts import encode

    folder, text, whole, draft = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = encode(tokenizer, PROMPT, raw=True)
    reference = greedy(text, ids)
    assert greedy(whole, ids) == reference and len(set(reference)) > 1
    want = tokenizer.decode(reference, skip_special_tokens=True)
    for mode, extra in (("ar", ()), ("sd", ("-d", draft)), ("sd", ("-d", folder))):
        r = run(PROMPT, "-m", folder, *extra, "--mode", mode, "-n", NEW, "--raw", "--json", "--verbose")
        assert r.exit_code == 0, r.stderr
        row = json.loads(r.stdout)
        assert row["text"] == want and row["new_tokens"] == len(reference), (mode, extra)
        assert row["prompt_tokens"] == len(ids)
        assert r.stderr.count(SAID) == (2 if extra == ("-d", folder) else 1)  # said once a load, in one line
        if mode == "sd":
            assert row["stats"]["draft_tokens"] > 0


def test_the_loaded_model_is_the_language_model_alone(checkpoint):
    """load_model hands over a gemma3_text causal LM over the checkpoint's language model and head
    (no vision tower, no meta tensor left from the shell), its generation config the checkpoint's."""
    from viasd_core.runtime.families import language_model
    from viasd_core.runtime.model import FastModel
    from viasd_core.loading.models import load_model

    folder, text, whole, _ = checkpoint
    said = []
    loaded = load_model(str(folder), device="cpu", progress=said.append)
    model = loaded.model
    assert model.config.model_type == "gemma3_text" and type(model).__name__ == "Gemma3ForCausalLM"
    assert not any("vision" in name or "multi_modal" in name for name, _ in model.named_parameters())
    assert all(p.device.type == "cpu" for p in model.parameters()) and not model.training
    assert [line for line in said if "multimodal" in line] == [
        f"{SAID} (text in, text out); its vision tower is left out"]
    assert model.generation_config.eos_token_id == 2
    state, want = model.state_dict(), text.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    assert FastModel(model, max_len=16).shape.family == "gemma3_text"
    # in memory, the same hand-over shares the multimodal model's modules
    shell = language_model(whole)
    assert shell.model is whole.model.language_model and shell.lm_head is whole.lm_head
    assert language_model(text) is text
