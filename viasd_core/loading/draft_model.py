"""The shipped-draft format: a few Llama layers plus a reduced-vocabulary head, sharing the target's embedding.

Folder layout (format "viasd-draft", version 1):

    config.json        {"format": "viasd-draft", "version": 1, "target": "smollm2-135m",
                        "llama_config": {...LlamaConfig kwargs, vocab_size = TARGET vocab...},
                        "draft_vocab_size": Vd, "tokenizer_vocab_sha256": "...", "training": {...}}
    model.safetensors  decoder layers, final norm, lm_head.weight [Vd, hidden], vocab_map [Vd] int64

The embedding matrix is NOT stored: `load_draft` plugs the target's embedding module into the draft
(shared, not copied). The draft's logits are over Vd draft ids; `draft.viasd_vocab_map[i]` is the
target token id of draft output i.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from viasd_core import paths
from viasd_core.errors import ViasdError
from viasd_core.loading.models import EMBEDDED_TARGET

FORMAT = "viasd-draft"
VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def embedded_draft_dir(target: str = EMBEDDED_TARGET) -> Path:
    """The draft folder shipped inside the package for `target` (default: the embedded SmolLM2-135M)."""
    return paths.package_data() / "drafts" / target


def tokenizer_vocab_sha256(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id pairs, sorted), to check that draft and target agree."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def rope_config(config) -> dict[str, Any]:
    """The RoPE settings of `config` in both spellings, so that a draft config read by either major
    version of transformers gets the target's cos/sin tables: `rope_parameters` (transformers 5) and
    the legacy `rope_theta` / `rope_scaling` (transformers 4 reads only these, and without them
    falls back to rope_theta 10000 and no scaling)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    out: dict[str, Any] = {}
    if theta is not None:
        params["rope_theta"] = out["rope_theta"] = float(theta)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    out["rope_scaling"] = scaling if params["rope_type"] != "default" else None
    out["rope_parameters"] = params
    return out


def draft_llama_config(target_config, num_layers: int) -> dict[str, Any]:
    """LlamaConfig kwargs for a `num_layers` draft of `target_config` (vocab_size stays the TARGET's)."""
    keys = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias",
        "bos_token_id", "eos_token_id", "pad_token_id", "vocab_size",
    )
    cfg = {k: getattr(target_config, k) for k in keys if getattr(target_config, k, None) is not None}
    cfg.update(rope_config(target_config))
    cfg["num_hidden_layers"] = num_layers
    cfg["tie_word_embeddings"] = False
    return cfg


def build_draft(llama_config: dict[str, Any], draft_vocab_size: int, embed_tokens: nn.Embedding):
    """An (untrained) LlamaForCausalLM draft: `embed_tokens` plugged in (shared), head [Vd, hidden]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # Build with vocab_size = Vd so no target-sized embedding is allocated; the lm_head then
    # already has the reduced shape. Then plug in the shared embedding and restore vocab_size.
    cfg = LlamaConfig(**{**llama_config, "vocab_size": draft_vocab_size, "tie_word_embeddings": False})
    draft = LlamaForCausalLM(cfg)
    if embed_tokens.embedding_dim != cfg.hidden_size:
        raise ViasdError(
            f"Draft hidden size {cfg.hidden_size} does not match the target embedding width {embed_tokens.embedding_dim}."
        )
    draft.set_input_embeddings(embed_tokens)
    draft.config.vocab_size = embed_tokens.num_embeddings  # input ids are target ids
    draft.to(embed_tokens.weight.dtype)
    return draft


def draft_state_dict(draft) -> dict[str, torch.Tensor]:
    """The weights a draft file stores: everything except the (shared) input embedding."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("model.embed_tokens.")}


def save_draft(
    folder: str | os.PathLike,
    draft,
    vocab_map: torch.Tensor,
    tokenizer,
    target: str,
    training: Optional[dict[str, Any]] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a draft folder atomically (temporary folder next to it, then rename). Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    vocab_map = vocab_map.to(torch.int64).cpu().contiguous()
    head = draft.get_output_embeddings().weight
    if head.shape[0] != vocab_map.numel():
        raise ViasdError(f"lm_head has {head.shape[0]} rows but vocab_map has {vocab_map.numel()} entries.")
    llama_config = draft_llama_config(draft.config, draft.config.num_hidden_layers)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "target": target,
        "llama_config": llama_config,
        "draft_vocab_size": int(vocab_map.numel()),
        "tokenizer_vocab_sha256": tokenizer_vocab_sha256(tokenizer),
        "training": training or {},
    }
    tensors = {k: v.detach().to(dtype).cpu().contiguous() for k, v in draft_state_dict(draft).items()}
    tensors["vocab_map"] = vocab_map
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for p in (tmp / WEIGHTS, tmp / CONFIG):
            p.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp makes it private; a shipped draft must be readable
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
            tmp.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def read_draft_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The draft's config.json, checked for format and version."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ViasdError(f"No draft at {folder}: {CONFIG} is missing.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ViasdError(f"Draft config {path} is not valid JSON ({e.msg}, line {e.lineno}).") from None
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ViasdError(
            f"{path} is not a viasd draft (format {config.get('format')!r} version {config.get('version')!r}; "
            f"expected {FORMAT!r} version {VERSION})."
        )
    return config


def load_draft(folder: str | os.PathLike, target_model, dtype: Optional[torch.dtype] = None, tokenizer=None):
    """Load a draft folder for `target_model`; returns a transformers LlamaForCausalLM.

    - `model.model.embed_tokens` IS the target's input-embedding module (shared, not copied).
    - `model.lm_head` is nn.Linear(hidden, Vd, bias=False); logits are [..., Vd].
    - `model.viasd_vocab_map` (LongTensor [Vd], on the model's device) maps draft index -> target id.
    Pass the target's `tokenizer` to have its vocabulary checked against the one the draft was
    trained with (raises ViasdError on a mismatch). Safetensors only. `dtype` defaults to the
    target embedding's dtype (it must match it, since the embedding is shared).
    """
    from safetensors import safe_open

    folder = Path(folder)
    config = read_draft_config(folder)
    if tokenizer is not None:
        sha = tokenizer_vocab_sha256(tokenizer)
        if sha != config.get("tokenizer_vocab_sha256"):
            raise ViasdError(
                f"The draft at {folder} was trained for a different tokenizer than this target's "
                f"(vocab sha256 {sha[:12]} != {str(config.get('tokenizer_vocab_sha256'))[:12]}); use a draft made for this target."
            )
    embed = target_model.get_input_embeddings()
    llama_config = config["llama_config"]
    if embed.num_embeddings != llama_config.get("vocab_size") or embed.embedding_dim != llama_config.get("hidden_size"):
        raise ViasdError(
            f"The draft at {folder} expects a target embedding of {llama_config.get('vocab_size')}x{llama_config.get('hidden_size')}, "
            f"this target has {embed.num_embeddings}x{embed.embedding_dim}."
        )
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise ViasdError(f"No draft weights at {weights} (only safetensors drafts are loaded).")
    dtype = dtype or embed.weight.dtype
    if dtype != embed.weight.dtype:
        raise ViasdError(f"Draft dtype {dtype} must match the target embedding dtype {embed.weight.dtype} (the embedding is shared).")

    vd = int(config["draft_vocab_size"])
    draft = build_draft(llama_config, vd, embed)
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    vocab_map = tensors.pop("vocab_map").to(torch.int64)
    expected = set(draft_state_dict(draft))
    if set(tensors) != expected or vocab_map.shape != (vd,):
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ViasdError(f"Draft weights at {weights} do not match its config (missing {missing[:3]}, unexpected {extra[:3]}).")
    if int(vocab_map.min()) < 0 or int(vocab_map.max()) >= embed.num_embeddings:
        raise ViasdError(f"Draft vocab_map at {weights} has ids outside the target vocabulary.")
    draft.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    device = embed.weight.device
    draft.to(device=device)
    draft.viasd_vocab_map = vocab_map.to(device)
    draft.viasd_config = config
    draft.eval()
    return draft
