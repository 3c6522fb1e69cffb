"""A new EAGLE-3 head for a target, in the published layout: shared (frozen) embedding, a reduced
output vocabulary (the ids the target emits most, `d2t`/`t2d` maps), lm_head rows and final norm
copied from the target (`init_head`), and its config.json (`head_config`)."""

from __future__ import annotations

from typing import Sequence

import torch

from viasd_core.speculation.eagle import LAYER_IDS_KEY, FeatureHead
from viasd_core.runtime.model import model_shape


def head_config(target_config, layers: Sequence[int], draft_vocab: int) -> dict:
    """config.json of a head for `target_config` (published layout: a one-layer Llama config)."""
    from viasd_core.loading.draft_model import rope_config

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "hidden_act")
    cfg = {k: getattr(target_config, k) for k in keys if getattr(target_config, k, None) is not None}
    cfg["head_dim"] = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    theta = rope_config(target_config).get("rope_theta")
    if theta is not None:
        cfg["rope_theta"] = theta
    cfg.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "vocab_size": int(target_config.vocab_size), "draft_vocab_size": int(draft_vocab),
                "target_hidden_size": target_config.hidden_size, LAYER_IDS_KEY: list(layers)})
    return cfg


def init_head(target, layers: Sequence[int], vocab_map: torch.Tensor, seed: int = 0) -> FeatureHead:
    """A new head for the HF `target` over draft ids `vocab_map` (sorted target ids): the target's
    embedding shared, its final norm and the lm_head rows of `vocab_map` copied; `fc` starts as
    "take the highest feature layer", the rest at PyTorch's default initialisation."""
    model_shape(target)  # refuses unsupported families with one line
    torch.manual_seed(seed)
    cfg = head_config(target.config, layers, vocab_map.numel())
    embed = target.get_input_embeddings()
    head = FeatureHead(cfg, tuple(layers), embed=embed)
    H = cfg["hidden_size"]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H :].copy_(torch.eye(H))
        head.norm.weight.copy_(target.get_decoder().norm.weight.float())
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab_map].float())
        head.d2t.copy_(vocab_map - torch.arange(vocab_map.numel()))
        head.t2d.zero_()
        head.t2d[vocab_map] = True
    return head.to(embed.weight.device)
