"""bitsandbytes 4-bit / 8-bit targets on CPU: loading, memory, the slim verifier, exactness."""

import copy
import importlib.util

import pytest
import torch

from viasd_core.errors import UsageError, ViasdError
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.loading.models import load_model, quantization_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory):
    from conftest import save_tiny_model_dir

    # hidden 128: bitsandbytes' 4-bit blocks need sizes divisible by its block size (64).
    folder = tmp_path_factory.mktemp("quant") / "target"
    import conftest

    model = conftest.tiny_model("llama", n_layers=4, seed=51, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=2)
    save_tiny_model_dir(folder, n_layers=4, seed=51)
    model.save_pretrained(folder)  # overwrite the weights with the 128-wide model
    return folder


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "layers." in n)


@pytest.mark.parametrize("quant, fraction", [("8bit", 0.25), ("4bit", 0.125)])
def test_quantized_layers_use_the_expected_fraction_of_memory(quant_dir, quant, fraction):
    full = load_model(str(quant_dir), device="cpu", with_tokenizer=False)
    q = load_model(str(quant_dir), device="cpu", quant=quant, with_tokenizer=False)
    ratio = weight_bytes(q.model) / weight_bytes(full.model)
    # fp32 -> int8 is 1/4 and -> nf4 is 1/8 of the linear weights; norms stay fp32 (a few %).
    assert fraction * 0.9 < ratio < fraction * 1.25, ratio
    assert q.quant == quant


@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_slim_verifier_from_a_quantized_target_equals_a_by_hand_reference(quant_dir, quant):
    from viasd_core.runtime.model import FastModel

    q = load_model(str(quant_dir), device="cpu", quant=quant, with_tokenizer=False).model
    kept = [0, 2, 3]
    # A shallow view of the model that runs only the kept layers (the same quantized modules).
    inner = copy.copy(q.model)
    inner._modules = dict(q.model._modules)
    inner.layers = torch.nn.ModuleList([q.model.layers[i] for i in kept])
    reference = copy.copy(q)
    reference._modules = dict(q._modules)
    reference.model = inner
    ids = torch.randint(8, 256, (10,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = reference(ids[None], use_cache=False).logits[0].float()
    slim = FastModel(q, layer_ids=kept, max_len=32)
    got = slim.forward(ids, 0, 10)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    assert slim.min_pass == 2  # quantized: never a single-token pass (another bitsandbytes kernel)
    # Shares the quantized weights: the same module objects, nothing copied.
    assert slim.layers[1] is q.model.layers[2]


@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_sd_and_exact_on_a_quantized_target_equal_ar_on_it(quant_dir, quant):
    from conftest import TinyTokenizer
    from viasd_core.speculation.drafters import ModelDrafter
    from viasd_core.speculation.engine import Engine, GenerationConfig
    from viasd_core.runtime.model import FastModel

    q = load_model(str(quant_dir), device="cpu", quant=quant, with_tokenizer=False).model
    prompt = torch.randint(8, 256, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    target = FastModel(q, max_len=96)
    ar = Engine(target, TinyTokenizer()).generate(prompt, GenerationConfig(mode="ar", max_new_tokens=30))
    for gamma in (2, 4):
        drafter = ModelDrafter(FastModel(q, layer_ids=[0, 3], max_len=96), target.shape.vocab_size)
        sd = Engine(target, TinyTokenizer(), drafter=drafter).generate(prompt, GenerationConfig(mode="sd", max_new_tokens=30, gamma=gamma))
        assert sd.tokens == ar.tokens
        slim = FastModel(q, layer_ids=[0, 1, 3], max_len=96)
        ex = Engine(target, TinyTokenizer(), drafter=drafter, slim=slim).generate(prompt, GenerationConfig(mode="exact", max_new_tokens=30, gamma=gamma))
        assert ex.tokens == ar.tokens


def test_unknown_quantization_is_a_usage_error():
    with pytest.raises(UsageError, match=r"unknown quantization .3bit.: use none, int8, int4, gguf \(torchao\) or 8bit, 4bit \(bitsandbytes\)"):
        quantization_config(WeightFormat.parse("3bit"), torch.float32)


def test_missing_bitsandbytes_names_the_missing_piece(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ViasdError, match="needs bitsandbytes: pip install"):
        quantization_config(WeightFormat.parse("4bit"), torch.float32)
