"""Real layer shapes on CPU: 2-layer random models with the geometry of Llama-3.1-8B (hidden 4096,
32 / 8 heads, MLP 14336, vocab 128256, rope_theta 500000 with llama3 scaling) and Qwen2.5-7B (3584,
28 / 4 heads, MLP 18944, vocab 152064, q/k/v biases, rope_theta 1e6), through ar, sd, exact and viasd,
eager and compiled, the int8 and int4 formats, and a short calibration. In float32, greedy sd and
exact emit ar's tokens exactly.

The families issue 50 added run at their real checkpoints' geometry too (`FAMILY_GEOMETRY`: Gemma-2-9B,
Gemma-3-1B, Phi-3-mini-4k, Qwen3-30B-A3B, 2 layers each; Mixtral-8x7B, 1 layer: its 8 experts of width
14336 are 1.4B parameters a layer, 5.6 GB in float32): FastModel's pass computes transformers' logits,
greedy ar emits transformers' tokens and sd emits ar's (eager float32).

Everything else in the suite runs models of width 64; these widths are the ones a GPU user loads
(the padded int4 CUDA layout of the same widths: tests/loading/test_weight_format_value.py). About 1B
parameters a model, 4 GB in float32 (tied embeddings; Mixtral's one layer 1.6B, 6.3 GB: its test
process peaked at 6.7 GB), one model at a time.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from conftest import TinyTokenizer, tiny_model
from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.router import Thresholds
from viasd_core.loading.synthetic import SHAPES

from conftest import needs_torchao

# The real sizes (bench's synthetic shapes); Llama 3.1 is Llama 3 with llama3 RoPE scaling and a longer context.
GEOMETRY = {
    "llama-3.1-8b": dict(SHAPES["llama-3-8b"]["target"], family="llama", max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2.5-7b": dict(SHAPES["qwen2.5-7b"]["target"], family="qwen2"),
}
# Issue 50's families, from the checkpoints' config.json (google/gemma-2-9b, google/gemma-3-1b-it,
# microsoft/Phi-3-mini-4k-instruct, Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1); 2 layers: one
# sliding and one global where the family alternates them (Gemma 3's global layers are every 6th in the
# checkpoint); Mixtral's 1 (one layer of its experts is 5.6 GB in float32).
FAMILY_GEOMETRY = {
    "gemma-2-9b": dict(family="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                       layer_types=["sliding_attention", "full_attention"]),
    "gemma-3-1b": dict(family="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=512, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "phi-3-mini-4k": dict(family="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                          num_attention_heads=32, num_key_value_heads=32, sliding_window=2047, hidden_act="silu",
                          max_position_embeddings=4096, original_max_position_embeddings=4096),
    "qwen3-30b-a3b": dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1000000.0,
                          max_position_embeddings=40960),
    "mixtral-8x7b": dict(family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=1000000.0, sliding_window=None, max_position_embeddings=32768,
                         layers_built=1),
}
PROMPT = [1, 9000, 15, 80000, 321, 4242]
NEW = 8
CONTEXT = 48


def fill_random_(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights, fast: every matrix row is a window of one random sequence, at a stride and
    offset of its own (independent enough for generic logits; drawing 1B normal numbers takes
    10-20 s here). Norm weights 1, biases small."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1 << 22, generator=g) * std
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            rows, cols = (p.numel() // p.shape[-1], p.shape[-1])  # a 3-d tensor (MoE experts): its rows of all
            stride = max(1, (base.numel() - cols) // max(rows - 1, 1))
            stride -= stride % 2 == 0 and stride > 1  # odd: rows do not repeat with the column period
            offset = int(torch.randint(0, base.numel() - (rows - 1) * stride - cols + 1, (1,), generator=g))
            p.copy_(base.as_strided((rows, cols), (stride, 1), offset).reshape(p.shape))


def real_shaped(name: str, seed: int = 0):
    """A float32 model of `name`'s geometry (2 layers unless it says) with tied embeddings, built without
    an init pass."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gc.collect()  # the model before it, let go by its fixture (`released`), is gone before this one is built
    spec = dict({**GEOMETRY, **FAMILY_GEOMETRY}[name])
    family = spec.pop("family")
    # the layers built: 2, or what the entry says (`layers_built`), never the checkpoint's own count
    # (GEOMETRY's configs carry num_hidden_layers 28-32: 30 GB in float32)
    spec.update(num_hidden_layers=spec.pop("layers_built", 2), tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    cfg = AutoConfig.for_model(family, **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # its frequencies, computed (to_empty left garbage)
    fill_random_(model, seed)
    embed = model.model.embed_tokens
    if hasattr(embed, "scalar_embed_scale"):  # Gemma's sqrt(hidden): a buffer to_empty left garbage too
        embed.embed_scale.fill_(embed.scalar_embed_scale)
        with torch.no_grad():  # the scaled rows as small as other families' (else each token predicts itself)
            embed.weight.div_(embed.scalar_embed_scale)
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def both_cores():
    """This module's passes are large matmuls: two threads (conftest's one suits the tiny models)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def released(model):
    """Yield `model`, then let it go: dynamo's graphs of the compiled tests hold its parameters (a
    4 GB model each) until its caches are reset, and this module builds seven such models."""
    yield model
    del model
    torch._dynamo.reset()
    gc.collect()


@pytest.fixture(scope="module", params=list(GEOMETRY))
def model(request):
    yield from released(real_shaped(request.param))


def engine(model, compiled: bool = False) -> Engine:
    """The real-shaped target, a tiny 1-layer draft of its vocabulary, and its first layer as the
    slim view. compiled: the target's passes (the real shapes' graphs; the draft's and the slim's
    are the tiny models' and one layer's, compiled in tests/speculation/test_compiled_step.py)."""
    vocab = model.config.vocab_size
    draft = tiny_model("llama", n_layers=1, vocab=vocab, seed=3)
    eng = Engine(FastModel(model, max_len=CONTEXT), TinyTokenizer(vocab),
                 drafter=ModelDrafter(FastModel(draft, max_len=CONTEXT, name="draft"), vocab),
                 slim=FastModel(model, layer_ids=[0], max_len=CONTEXT, name="slim"))
    if compiled:
        assert eng.target.compile()
    return eng


def generate(eng: Engine, mode: str, **config):
    """NEW tokens after PROMPT; blocks of 2 (a verify pass of 3 tokens, 4 compiled): every pass
    computes logits over the whole vocabulary, which dominates this module's time."""
    eng.reset()
    return eng.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=2, adaptive=False, **config))


@pytest.fixture(scope="module")
def eager_ar(model) -> list[int]:
    tokens = generate(engine(model), "ar").tokens
    assert len(tokens) == NEW and len(set(tokens)) > 1
    return tokens


def test_the_fast_pass_computes_transformers_logits(model):
    """Rope scaling (llama3), grouped-query attention 4:1 and 7:1, Qwen's q/k/v biases: FastModel's
    pass equals transformers' forward at these shapes."""
    from viasd_core.runtime.rope import rope_types

    qwen = model.config.model_type == "qwen2"
    assert rope_types(model.config) == ["default" if qwen else "llama3"]
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == qwen
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        want = model(ids[None]).logits[0]
    fast = FastModel(model, max_len=CONTEXT)
    torch.testing.assert_close(fast.forward(ids, 0, n_logits=len(PROMPT)), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_greedy_sd_and_exact_equal_ar_and_viasd_runs(model, eager_ar, compiled):
    eng = engine(model, compiled)
    cfg, s = model.config, eng.target.shape
    assert (s.hidden_size, s.n_heads, s.n_kv_heads, s.head_dim, s.vocab_size) == (
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, 128, cfg.vocab_size)
    if compiled:  # the compiled graphs compute eager's tokens
        assert generate(eng, "ar").tokens == eager_ar
    for mode in ("sd", "exact"):
        out = generate(eng, mode)
        assert out.tokens == eager_ar, mode
        assert out.stats.draft_tokens > 0, mode
    # viasd with thresholds by hand: accept the draft where the slim view agrees, the slim's token
    # everywhere else. With every layer in the slim view, viasd then emits the target's tokens with
    # the target running at most once (a last plain step).
    eng.slim = FastModel(model, max_len=CONTEXT, name="slim")
    if compiled:
        assert eng.slim.compile()
    viasd = generate(eng, "viasd", thresholds=Thresholds(accept=1.0, slim=0.0))
    assert viasd.tokens == eager_ar and viasd.stats.slim_passes > 0 and viasd.stats.target_passes <= 1
    assert viasd.stats.tier_counts["slim"] > 0


LAYER_SHAPES = ("q_proj", "k_proj", "down_proj", "up_proj")  # (out, in): (h, h), (kv, h), (h, i), (i, h)


@needs_torchao
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_real_width_layers_pack_to_their_format(model, fmt):
    """Each distinct layer shape, packed from the model's own weights on CPU: the kernel applies the
    format's weight (within half a quantization step; int8 exactly the levels of its rows)."""
    from viasd_core.runtime.weight_format import WeightFormat
    from viasd_core.runtime.weight_formats import INT4_GROUP, PackedLinear, apply_weight_format

    layer = model.model.layers[0]
    for name in LAYER_SHAPES:
        linear = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
        rows = 64  # of the output rows: packing the whole layer takes seconds, and every row is packed alike
        probe = torch.nn.Linear(linear.in_features, rows, bias=False)
        with torch.no_grad():
            probe.weight.copy_(linear.weight[:rows])
        holder = torch.nn.Sequential(probe.to(torch.bfloat16))
        w = holder[0].weight.detach().double()
        apply_weight_format(holder, WeightFormat.parse(fmt))
        packed = holder[0]
        assert isinstance(packed, PackedLinear) and packed.kind == fmt and packed.packed_in == linear.in_features
        x = torch.randn(3, linear.in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        got = packed(x).double()
        if fmt == "int8":
            applied = packed.qdata.double() * packed.scale.double()[:, None]
            assert ((applied - w).abs() <= packed.scale.double()[:, None] / 2 * 1.01).all(), name
            bound = 2**-7 * (x.double().abs() @ applied.abs().T) + 1e-6
        else:
            g = w.reshape(rows, -1, INT4_GROUP)
            step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(w.shape)
            applied = w  # the bound below: every weight within 0.65 of its group's step
            bound = (0.65 * step.abs() + 2**-8 * w.abs()) @ x.double().abs().T
            bound = bound.T + 2**-7 * (x.double().abs() @ w.abs().T)
        assert ((got - x.double() @ applied.T).abs() <= bound).all(), name


def test_a_short_calibration_on_real_shapes(model, monkeypatch):
    """Calibration's steps on the real shapes (calibrate.py, without the model files): a layer mask
    scored on text, pass costs, gates recorded over sd runs, thresholds fitted to a budget (viasd
    itself runs in the test above). At 2 layers the search keeps both (the first and last are
    always kept), so the view measured is the first layer alone. Shortened: costs from one pass
    after 8 positions, 5 tokens recorded."""
    from viasd_core.calibration import candidates as cand
    from viasd_core.calibration.costs import measure_costs, pass_costs
    from viasd_core.calibration.mask_search import MaskEvaluator, search_layer_mask
    from viasd_core.runtime.slim_view import SlimView

    monkeypatch.setattr(cand, "pass_costs", functools.partial(pass_costs, context=8, repeats=1))
    eng = engine(model)
    text = PROMPT + [7, 100, 2000, 30000, 5, 64]
    evaluator = MaskEvaluator(model, [text])
    search = search_layer_mask(evaluator, skip_ratio=0.45)
    assert search.best.layer_ids == [0, 1] and search.best.agreement == 1.0  # the target itself
    costs = measure_costs(eng.target, eng.drafter.model, context=8, block=3, repeats=1)
    assert costs["block"] == 3 and min(costs["target"], costs["target_1"], costs["draft"]) > 0
    config = GenerationConfig(mode="sd", max_new_tokens=5, gamma=2, adaptive=False)  # each step records a slim pass too
    budget = 0.2
    (chosen,) = cand.measure_candidates(eng, evaluator, [SlimView((0,))], [PROMPT], config, costs, budget)
    assert chosen.fit is not None and 0 <= chosen.agreement < 1 and chosen.costs["slim"] > 0
    outcome = chosen.fit.outcome
    assert 0 < outcome.tokens <= 5 and outcome.drafted > 0  # the recorded blocks, replayed
    if chosen.fit.thresholds.active:
        assert outcome.fidelity >= 1 - budget


@pytest.fixture(scope="module", params=list(FAMILY_GEOMETRY))
def family_model(request):
    yield from released(real_shaped(request.param))


def test_the_new_families_compute_transformers_logits_and_greedy_tokens(family_model):
    """Gemma 2's caps and four norms at 256-wide heads, Gemma 3's two RoPE tables with one KV head,
    Phi-3's fused q/k/v (32 KV heads) and sliding window, Qwen3-MoE's 128 experts (8 a token),
    Mixtral's 8 experts of width 14336 (2 a token) without a window: the
    pass (a prefill, then 1-token and 3-token passes) computes transformers' logits; greedy ar emits
    transformers' generate() tokens, and sd (blocks of 2) emits ar's."""
    model = family_model
    vocab = model.config.vocab_size
    prompt = [t % vocab for t in PROMPT]
    ids = torch.tensor(prompt + [7, 100, 2000, 5])
    with torch.inference_mode():
        want = model(ids[None]).logits[0]
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                   eos_token_id=None)[0, len(prompt):].tolist()
    fast = FastModel(model, max_len=CONTEXT)
    got = torch.cat([fast.forward(ids[:6], 0, 6), fast.forward(ids[6:7], 6, 1), fast.forward(ids[7:10], 7, 3)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    eng = engine(model)
    ar = eng.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
    assert ar.tokens == reference and len(set(reference)) > 1
    eng.reset()
    sd = eng.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=2, adaptive=False))
    assert sd.tokens == reference and sd.stats.draft_tokens > 0
