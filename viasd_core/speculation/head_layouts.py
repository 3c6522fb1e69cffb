"""The two folder layouts an EAGLE-3 head is published in, and the one rule that maps each onto
the other (used to load either, eagle_files.py, and to write either, loading/head_export.py).

EAGLE-3 layout (SafeAILab/EAGLE, yuhuili/EAGLE3-*; what eagle.py documents and viasd writes):
a flat Llama `config.json` with `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` (top level or under `eagle_config`); the layer's tensors under
`midlayer.*`.

speculators layout (vllm-project/speculators, `Eagle3SpeculatorConfig` in
src/speculators/models/eagle3/config.py and `Eagle3DraftModel` in .../eagle3/core.py; read by vLLM's
vllm/transformers_utils/configs/speculators/{base,algos}.py): the Llama settings nested under
`transformer_layer_config`; `speculators_model_type: "eagle3"`, `draft_vocab_size`,
`norm_before_residual`, `norm_before_fc`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`
at the top; `speculators_config` (proposal methods with `speculative_tokens`, the verifier); the
layer's tensors under `layers.0.*` (fc, norm, lm_head, d2t, t2d and an optional embed_tokens named
as in the EAGLE-3 layout). `norm_before_residual` (the residual taken after hidden_norm) maps onto
the same key of the flat config, which eagle.FeatureHead honours.
"""

from __future__ import annotations

import torch

from viasd_core.errors import ViasdError

MIDLAYER = "midlayer."
SPEC_LAYER = "layers.0."
SPECULATORS_TYPE = "eagle3"
# Top-level keys of a speculators config that are EAGLE-3 settings (the rest of the flat config
# is the Llama layer's, nested under transformer_layer_config).
SPEC_TOP_KEYS = ("draft_vocab_size", "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")
# Tensors the speculators trainer may save beside the head's that drafting never reads.
SPEC_TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")


def is_speculators_config(raw: dict) -> bool:
    return "speculators_model_type" in raw or "transformer_layer_config" in raw


def flat_config(raw: dict, where: str) -> dict:
    """The flat (EAGLE-3 layout) config of `raw`: `raw` itself unless it is a speculators config,
    whose layer settings are lifted from transformer_layer_config. Variants the head does not
    implement are refused in one line."""
    if not is_speculators_config(raw):
        return raw
    kind = raw.get("speculators_model_type")
    if kind != SPECULATORS_TYPE:
        raise ViasdError(f"{where}: speculators_model_type {kind!r} is not an EAGLE-3 head ('{SPECULATORS_TYPE}')")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ViasdError(f"{where}: a speculators config without a transformer_layer_config object")
    if layer.get("model_type", "llama") != "llama":
        raise ViasdError(f"{where}: a {layer['model_type']!r} draft layer; only Llama-layer EAGLE-3 heads are supported")
    if raw.get("norm_before_fc"):
        raise ViasdError(f"{where}: norm_before_fc (an RMSNorm over the target's features before fc) is not supported")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "tie_word_embeddings")}
    flat.update({k: raw[k] for k in SPEC_TOP_KEYS if raw.get(k) is not None})
    # The speculators library always writes norm_before_residual; vLLM reads a missing one as True
    # (configs/speculators/algos.py update_eagle3), so a hand-written config without it is read so too.
    flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))
    flat["architectures"] = ["LlamaForCausalLMEagle3"]
    flat["model_type"] = "llama"
    return flat


def eagle3_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensor names of either layout -> the EAGLE-3 layout's (`layers.0.*` -> `midlayer.*`; the
    speculators trainer's verifier copies dropped). Other names are kept, to be checked as usual."""
    out = {}
    for name, tensor in tensors.items():
        if name in SPEC_TRAINING_ONLY:
            continue
        out[MIDLAYER + name[len(SPEC_LAYER):] if name.startswith(SPEC_LAYER) else name] = tensor
    return out


def speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EAGLE-3 layout names -> the speculators layout's (`midlayer.*` -> `layers.0.*`)."""
    return {SPEC_LAYER + k[len(MIDLAYER):] if k.startswith(MIDLAYER) else k: v for k, v in tensors.items()}


def speculators_config(flat: dict, layers: list[int] | None, *, speculative_tokens: int, verifier: str | None,
                       verifier_architectures: list | None = None) -> dict:
    """The speculators config.json of a head whose flat config is `flat` (the inverse of flat_config);
    `layers`: the target layers whose inputs it reads, None when the config leaves them to the
    default (2, L//2, L-3), as vLLM does too."""
    layer = {k: v for k, v in flat.items()
             if k not in SPEC_TOP_KEYS and k not in ("architectures", "eagle_config", "viasd_training", "model_type")}
    layer.update({"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False})
    out = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": SPECULATORS_TYPE,
        "draft_vocab_size": int(flat.get("draft_vocab_size") or flat["vocab_size"]),
        # written even when False: vLLM reads a missing key as True (configs/speculators/algos.py)
        "norm_before_residual": bool(flat.get("norm_before_residual", False)),
        "norm_before_fc": False,
        "target_hidden_size": int(flat.get("target_hidden_size") or flat["hidden_size"]),
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": SPECULATORS_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
    }
    if layers is not None:  # read as they are by vLLM (gpu_model_runner._get_eagle3_aux_layers_from_config)
        out["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in layers]
    return out
