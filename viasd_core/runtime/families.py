"""The model families FastModel runs, what sets each apart, and the one-line refusals of the rest.

FastModel's pass is one decoder layer shape: norm, attention, residual add, norm, MLP, residual add.
The families differ from it in a few places, each read here (or in layer_calls.py, per layer) from
the transformers modules and config, never from the family's name alone where the module says it:

- llama, mistral, qwen2, qwen3: the plain shape (qwen3: per-head q/k norms; mistral: one sliding window).
- gemma: Gemma's (1 + w) RMSNorm (the module's own forward) and a scaled embedding (the module's).
- gemma2: also four norms a layer (the attention's and the MLP's outputs normed before their residual
  adds: layer_calls.py), attention logits soft-capped (tanh; `attn_softcap`), final logits soft-capped
  (`final_softcap`), 1/sqrt(query_pre_attn_scalar) scaling (the module's `scaling`), sliding-window
  layers alternating with global ones (each attention module's `sliding_window`).
- gemma3_text: gemma2's layer without attention soft-capping, with per-head q/k norms, and a RoPE
  table per layer type (the sliding layers' own base: `rope_tables`).
- phi3 (Phi-3, Phi-4): q/k/v and gate/up as one projection each (layer_calls.py), one sliding window
  for every layer where the config sets one; partial rotary (`partial_rotary_factor`, a table narrower
  than the head: rope.apply_rope rotates its first part only).
- qwen3_moe, mixtral: a sparse MoE block for the MLP (Qwen3-MoE: qwen3's attention, its dense
  `mlp_only_layers` as before; Mixtral: mistral's attention and window, where the config sets one), run
  through its module, one row at a time in short passes (layer_calls.py: each row's experts computed
  as in a pass of that row alone).

A multimodal checkpoint whose language model is one of these families (`MULTIMODAL`: Gemma 3's
`gemma3`, a SigLIP vision tower beside a gemma3_text model) runs as that language model alone:
`language_model` hands it over at load, and its config is checked by its text config.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from viasd_core.errors import ViasdError
from viasd_core.runtime.rope import check_rope, exact_positions, rope_types

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "qwen3_moe",
                      "mixtral")
CONFIG_WINDOW = ("mistral", "phi3", "mixtral")  # one sliding window from the config, for every layer
# Multimodal checkpoints viasd generates text with, through their language model (`language_model`):
# gemma3, a gemma3_text model (its text_config) beside a vision tower
MULTIMODAL = ("gemma3",)


@dataclass(frozen=True)
class ModelShape:
    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int  # the context viasd runs: the config's, or less where its RoPE changes past a point
    positions_why: str = ""  # why max_positions is below the config's context ("" when it is not)


def check_family(cfg) -> str:
    """`cfg`'s family (its model_type; a multimodal checkpoint's: its language model's), or a one-line
    ViasdError for a family or a setting FastModel does not run; read from the config alone, so that
    loading refuses before any weight is read."""
    family = getattr(cfg, "model_type", "?")
    if family in MULTIMODAL:  # checked by its language model's config
        return check_family(cfg.text_config)
    if family not in SUPPORTED_FAMILIES:
        raise ViasdError(
            f"model family '{family}' is not supported yet (supported: {', '.join(SUPPORTED_FAMILIES)}); "
            "use a model of one of those families"
        )
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ViasdError(f"this {family} model attends bidirectionally (an embedding model, not a decoder): "
                         "viasd decodes causal language models only")
    check_rope(cfg, up_to_original=True)
    return family


def model_shape(hf_model) -> ModelShape:
    """The model's geometry; a one-line ViasdError for a family or a setting FastModel does not run."""
    cfg = hf_model.config
    if getattr(cfg, "model_type", None) in MULTIMODAL:
        raise ViasdError(f"this is a multimodal {cfg.model_type} model: FastModel runs its language model, "
                         "families.language_model(model) (loading.models.load_model hands it over)")
    family = check_family(cfg)
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    context = getattr(cfg, "max_position_embeddings", 4096)
    limit, why = exact_positions(cfg), ""
    if limit is not None and limit < context:
        why = (f"its '{rope_types(cfg)[0]}' RoPE changes its frequencies past {limit} positions, "
               "which one fixed table cannot follow")
        context = limit
    return ModelShape(
        family=family,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=hf_model.get_output_embeddings().out_features,
        max_positions=context,
        positions_why=why,
    )


def language_model(hf_model, say=None):
    """The causal LM viasd runs of a loaded transformers model: the model itself, or for a multimodal
    checkpoint (MULTIMODAL) its language model and output head as its text family's causal LM
    (transformers 5: `model.model.language_model` and `model.lm_head`, the same modules and weights,
    the text config and the checkpoint's generation config); the vision tower is left out (freed once
    the caller drops the multimodal model). `say`: a callable told so in one line."""
    cfg = hf_model.config
    if getattr(cfg, "model_type", None) not in MULTIMODAL:
        return hf_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # an empty shell: both of its modules are replaced below
        text = AutoModelForCausalLM.from_config(cfg.text_config)
    text.model = hf_model.model.language_model
    text.lm_head = hf_model.lm_head
    text.generation_config = hf_model.generation_config
    if getattr(hf_model, "hf_quantizer", None) is not None:  # bitsandbytes weights (FastModel reads it)
        text.hf_quantizer = hf_model.hf_quantizer
    text.eval()
    if say is not None:
        say(f"a multimodal {cfg.model_type} checkpoint: viasd runs its {cfg.text_config.model_type} language model "
            "(text in, text out); its vision tower is left out")
    return text


def check_embedding(family: str, embed: torch.nn.Module) -> None:
    """Gemma families scale their embedding by sqrt(hidden) inside the module from transformers 5.4 on."""
    if family.startswith("gemma") and getattr(embed, "embed_scale", None) is None:
        raise ViasdError("this Gemma model's embedding has no sqrt(hidden) scale (transformers < 5.4 applies it "
                         "outside the module): upgrade transformers to 5.4 or later")


def window(family: str, config, layer: torch.nn.Module) -> int | None:
    """The layer's sliding window (None: global attention): its attention module's, else the config's
    for the families that set one window for all layers."""
    w = getattr(layer.self_attn, "sliding_window", None)
    if w is None and family in CONFIG_WINDOW:
        w = getattr(config, "sliding_window", None)
    return int(w) if w else None


def attn_softcap(layer: torch.nn.Module) -> float | None:
    """The cap c of tanh(scores / c) * c on the layer's attention logits (Gemma 2), or None."""
    cap = getattr(layer.self_attn, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def final_softcap(config) -> float | None:
    """The cap on the output logits (Gemma 2, and Gemma 3 where its config sets one), or None."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap, as transformers computes it (elementwise: each row alone)."""
    return torch.tanh(x / cap) * cap


def rope_tables(hf_model, layer_ids: list[int], positions: torch.Tensor, dtype) -> tuple[list, list[int]]:
    """The RoPE tables (cos, sin) [positions, rotary dim] the run layers read, and each run layer's
    table: one table, or one per layer type where the rotary embedding takes the layer's type
    (Gemma 3: the sliding layers' own base frequency). A partial rotary's table is narrower than the
    head (always even: transformers doubles its frequencies), and rope.apply_rope rotates that part."""
    rotary, cfg = hf_model.get_decoder().rotary_emb, hf_model.config
    dummy = torch.zeros(1, dtype=dtype, device=positions.device)
    limit = exact_positions(cfg)
    if limit is not None:  # rows past it are never run (the context stops there): keep the short table
        positions = positions.clamp(max=limit - 1)
    with torch.no_grad():
        if "layer_type" not in inspect.signature(rotary.forward).parameters:
            cos, sin = rotary(dummy, positions[None])
            tables, index = [(cos[0].to(dtype), sin[0].to(dtype))], [0] * len(layer_ids)
        else:
            types = [cfg.layer_types[i] for i in layer_ids]
            kinds = sorted(set(types))
            tables = [tuple(t[0].to(dtype) for t in rotary(dummy, positions[None], kind)) for kind in kinds]
            index = [kinds.index(t) for t in types]
    return tables, index
