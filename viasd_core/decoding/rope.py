"""Which RoPE types the engine can run, and `apply_rope`, the one rotation FastModel and the EAGLE head apply.

`FastModel` builds one cos/sin table for all positions up to its cache length and reads it by
position. That is right only for RoPE types whose frequencies are fixed by the config. In
transformers' `modeling_rope_utils.py` (checked on 5.4 and 5.23), `default`, `linear`, `llama3`
and `yarn` ignore the sequence length; `dynamic` (NTK) recomputes its frequencies from the
current length and `longrope` switches between short and long factors past
`original_max_position_embeddings`, so one table would be silently wrong for them: refused.
"""

from __future__ import annotations

import torch

from viasd_core.errors import ViasdError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_types(config) -> list[str]:
    """The RoPE type(s) a transformers config declares: one, or one per layer type when nested."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return ["default"]
    groups = [v for v in params.values() if isinstance(v, dict)] or [params]
    return [str(g.get("rope_type", g.get("type", "default"))) for g in groups]


def check_rope(config) -> None:
    """Raise a one-line ViasdError unless every RoPE type of `config` is one the engine runs exactly."""
    for rope_type in rope_types(config):
        if rope_type in STATIC_ROPE_TYPES:
            continue
        why = ("its frequencies depend on the current sequence length"
               if any(t in rope_type for t in _LENGTH_DEPENDENT) else "viasd does not know it")
        raise ViasdError(
            f"RoPE type '{rope_type}' is not supported ({why}); supported: {', '.join(STATIC_ROPE_TYPES)}"
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated by the table rows cos, sin [T, D] of its positions (transformers' layout:
    the pairs (i, i + D/2), `rotate_half`)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
