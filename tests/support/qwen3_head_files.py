"""A published Qwen3 EAGLE-3 head's files, scaled down for the tiny Qwen3 target (hidden 64,
vocabulary 256): shared by tests/loading/test_qwen3_heads.py and tests/speculation/test_draft_auto.py."""

from __future__ import annotations

import io
import json

import torch
from safetensors.torch import save_file

from viasd_core.speculation.eagle import FeatureHead

VOCAB, DRAFT_VOCAB = 256, 40

# AngelSlim's configs/qwen3-4b-eagle3.json scaled down: a Llama head whose attention is wider than
# its hidden size (heads * head_dim = 128 against 64), Qwen3's RoPE base, a tied-embeddings flag
# (ignored: the head has its own lm_head over the draft vocabulary), no feature layers.
ANGELSLIM = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "torch_dtype": "bfloat16",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
    "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 8, "num_hidden_layers": 1,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
}


def head_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the published names and shapes of `config`'s head, a d2t/t2d pair over
    random target ids, and no embedding (the head shares the target's)."""
    torch.manual_seed(seed)
    head = FeatureHead(config, (2, 4, 5))
    tensors = {k: v.clone() for k, v in head.state_dict().items() if k != "embed_tokens.weight"}
    hot = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    tensors["d2t"] = hot - torch.arange(DRAFT_VOCAB)
    tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    tensors["t2d"][hot] = True
    return tensors


def write(folder, config: dict, tensors: dict, fmt: str = "safetensors"):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if fmt == "safetensors":
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        torch.save(tensors, folder / "pytorch_model.bin")
    return folder


def published_files(config: dict = ANGELSLIM, seed: int = 0) -> dict[str, bytes]:
    """The head as a hub repo holds it: config.json and pytorch_model.bin (AngelSlim's heads ship a .bin)."""
    buf = io.BytesIO()
    torch.save(head_tensors(config, seed), buf)
    return {"config.json": json.dumps(config).encode(), "pytorch_model.bin": buf.getvalue()}
