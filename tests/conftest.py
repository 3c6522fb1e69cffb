"""Shared fixtures: tiny random models of each supported family, built in the test from configs.

Fast, deterministic, no files, no network.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread: tiny models gain nothing from more, and the test machine is usually shared.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _session_home(tmp_path_factory):
    """A temporary home for the whole run, so that what a test measures and caches lazily (the
    bfloat16 verdict, say) never lands in the user's cache; `viasd_home` gives a test its own. The
    packed products' way is pinned for the run (tests/machine/test_packed_way.py unpins it)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("VIASD_HOME", str(tmp_path_factory.mktemp("session_home")))
    # the packed products' way pinned to the one the kernels' tests name (machine/packed_way.py):
    # a timed choice could differ between test processes (a CLI's subprocess, an xdist worker)
    patch.setenv("VIASD_PACKED_WAY", "bf16")
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _one_thread_again():
    """Sessions resolve --threads (auto by default: threads.py) and set torch's count; the next test
    starts from one thread again."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_caches():
    """dynamo's caches cleared after each test module: one process compiles hundreds of models'
    graphs over the suite, and every graph of FastModel's shared pass counts against dynamo's
    recompile limit (a real session compiles one target, its draft and slim views)."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


# tests of the int8/int4 formats need torchao (installed with the quant extra, as CI does)
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")

VOCAB = 256
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma")
# The families issue 50 added (Gemma 2, Gemma 3 text, Phi-3/4, Qwen3-MoE, Mixtral): tests/loading/test_families.py
# runs them through the exactness checks (transformers' logits and greedy tokens, sd == ar, row invariance).
NEW_FAMILIES = ("gemma2", "gemma3_text", "phi3", "qwen3_moe", "mixtral")
ALTERNATING = ["sliding_attention", "full_attention"]  # Gemma 2/3's layer types, repeated over the layers


def tiny_config(family: str, n_layers: int = 4, vocab: int = VOCAB, seed: int = 0, **extra):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Large init: peaked next-token distributions, so fp32 argmax ties are vanishingly rare.
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family in ("gemma", "qwen3", "gemma2", "gemma3_text", "qwen3_moe"):
        common["head_dim"] = 16  # their configs default to a head_dim that ignores hidden_size / heads
        common["hidden_activation"] = "gelu_pytorch_tanh"
    if family == "mistral":
        common["sliding_window"] = 4096
    if family in ("gemma2", "gemma3_text"):
        # windows of 8 keys alternating with global layers, within the tests' ~50 positions; scores
        # scaled by query_pre_attn_scalar (not head_dim)
        common.update(sliding_window=8, query_pre_attn_scalar=24, layer_types=(ALTERNATING * n_layers)[:n_layers])
    if family == "gemma2":  # caps near the tiny models' scores and logits (~10), so that they count
        common.update(attn_logit_softcapping=5.0, final_logit_softcapping=12.0)
    if family == "gemma3_text":  # the sliding layers' own RoPE base (rope_local_base_freq)
        common["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    if family == "phi3":
        common["partial_rotary_factor"] = 0.75  # Phi-4-mini's: 12 of each head's 16 dimensions rotate
    if family == "qwen3_moe":  # 4 experts, 2 a token; layer 1 a dense MLP (mlp_only_layers)
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[1] if n_layers > 1 else [])
    if family == "mixtral":  # 4 experts of width 128, 2 a token; no sliding window (Mixtral-8x7B's null)
        common.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    common.update(extra)
    return AutoConfig.for_model(family, **common)


def multimodal_config(n_layers: int = 2, **text_extra):
    """A multimodal Gemma 3 config (Gemma3ForConditionalGeneration): a tiny gemma3_text language
    model (tiny_config) beside a tiny SigLIP vision tower (one layer, 28-pixel images of 4 patches)."""
    from transformers import Gemma3Config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    text = tiny_config("gemma3_text", n_layers=n_layers, **text_extra).to_dict()
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                        tie_word_embeddings=text["tie_word_embeddings"])


def tiny_model(family: str = "llama", n_layers: int = 4, seed: int = 0, vocab: int = VOCAB, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, n_layers=n_layers, vocab=vocab, **extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if family in ("gemma2", "gemma3_text"):  # their (1 + w) norms start at w = 0: make w count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    model.eval()
    return model


def every_kind_of_pass(fast, ids: torch.Tensor) -> torch.Tensor:
    """A prefill, 1-token steps, a 4-token block and a 6-token one after a rollback over ids[:30],
    the logits of every position, concatenated: what a pass-level rewrite must leave unchanged."""
    out = [fast.forward(ids[:20], 0, 20)]
    out += [fast.forward(ids[i : i + 1], i, 1) for i in range(20, 23)]
    out.append(fast.forward(ids[23:27], 23, 4))
    fast.rollback(24)
    out.append(fast.forward(ids[24:30], 24, 6))
    return torch.cat(out)


def record_forward(fast) -> list[tuple[int, int]]:
    """Wrap a FastModel's `forward` to record (start, length) of every pass it really runs."""
    calls: list[tuple[int, int]] = []
    inner = fast.forward

    def forward(input_ids, start, n_logits=1):
        calls.append((start, input_ids.shape[0]))
        return inner(input_ids, start, n_logits=n_logits)

    fast.forward = forward
    return calls


def positions_run(calls: list[tuple[int, int]], end: int) -> list[int]:
    """The positions below `end` that the recorded passes ran, in order (repeats kept)."""
    return [p for start, length in calls for p in range(start, start + length) if p < end]


class TinyTokenizer:
    """The part of a tokenizer the engine uses: decode token ids to text."""

    def __init__(self, vocab: int = VOCAB, special=(0, 1, 2)):
        self.vocab = vocab
        self.special = set(special)

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i in self.special))


@pytest.fixture
def viasd_home(tmp_path, monkeypatch):
    """A temporary home: no test touches the user's cache or config."""
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "viasd_home"))
    return tmp_path / "viasd_home"


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"


def save_tiny_model_dir(folder, family="llama", n_layers=4, seed=0, words=None, model=None):
    """A real (tiny, random) model folder: config, safetensors, WordLevel tokenizer with a chat template.
    `model`: the model saved (a multimodal Gemma 3, say) instead of tiny_model(family, n_layers, seed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = model if model is not None else tiny_model(family, n_layers=n_layers, seed=seed)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    words = words or [f"w{i}" for i in range(VOCAB - 8)]
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>", "<system>", "<x>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Folders of a tiny target, a tiny draft of the same vocabulary, and a draft of another vocabulary."""
    base = tmp_path_factory.mktemp("models")
    target = save_tiny_model_dir(base / "target", n_layers=4, seed=31)
    draft = save_tiny_model_dir(base / "draft", n_layers=1, seed=32)
    other = save_tiny_model_dir(base / "other", n_layers=1, seed=33, words=[f"z{i}" for i in range(VOCAB - 8)])
    return {"target": target, "draft": draft, "other": other}
