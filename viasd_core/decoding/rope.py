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


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sine table [..., D] as `apply_rope` takes it: its first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated by the table rows cos, sin [T, D] of its positions, sin given as
    `signed_sin(sin)` (transformers' layout: the pairs (i, i + D/2), `rotate_half`).

    transformers computes x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). That is
    x * cos + roll(x, D/2) * signed_sin(sin): the same products up to a sign, and a sign flip is
    exact, so every value is bit for bit the same (tests/test_model_rope.py compares it with
    `apply_rope_reference`), in four operators instead of six (two calls a layer and pass).

    Partial rotary (Phi-4-mini's `partial_rotary_factor`): a table narrower than x rotates x's first
    part only and keeps the rest, as transformers' Phi-3 does."""
    width = cos.shape[-1]
    if width != x.shape[-1]:
        part = x[..., :width]
        return torch.cat((part * cos + part.roll(width // 2, -1) * sin_signed, x[..., width:]), dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` as transformers writes it, over the plain sine table (partial: its first part)."""
    width = cos.shape[-1]
    rot, rest = x[..., :width], x[..., width:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat((rot * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)
