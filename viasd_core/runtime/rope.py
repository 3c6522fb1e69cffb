"""Which RoPE types the engine can run, and `apply_rope`, the one rotation FastModel and the EAGLE head apply.

`FastModel` builds one cos/sin table for all positions up to its cache length and reads it by
position. That is right only for RoPE types whose frequencies are fixed by the config. In
transformers' `modeling_rope_utils.py` (checked on 5.4, 5.23 and 5.24), `default`, `linear`, `llama3`
and `yarn` ignore the sequence length. Two types change their frequencies with the current length,
but only past a context the config names: `longrope` (Phi-3 128k, Phi-3.5, Phi-4-mini) takes its
long factors once a call's last position passes `original_max_position_embeddings`, and `dynamic`
(NTK) grows its base once it passes `max_position_embeddings`. Up to that context both are one
fixed table (longrope's short factors, with its attention factor; dynamic's original frequencies),
so viasd runs them there and no further: `exact_positions` is the model's context for viasd.
"""

from __future__ import annotations

import torch

from viasd_core.errors import ViasdError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LENGTH_DEPENDENT = ("dynamic", "longrope")  # one fixed table up to the context exact_positions gives


def _groups(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return [{}]
    return [v for v in params.values() if isinstance(v, dict)] or [params]


def rope_types(config) -> list[str]:
    """The RoPE type(s) a transformers config declares: one, or one per layer type when nested."""
    return [str(g.get("rope_type", g.get("type", "default"))) for g in _groups(config)]


def exact_positions(config) -> int | None:
    """The positions one fixed RoPE table serves as transformers computes them: None (every one) for
    the static types; for `longrope` its `original_max_position_embeddings`, for `dynamic` the
    config's `max_position_embeddings` (past them their frequencies change with the length)."""
    limits = []
    for g in _groups(config):
        kind = str(g.get("rope_type", g.get("type", "default")))
        if kind == "longrope":
            limits.append(int(g.get("original_max_position_embeddings")
                              or getattr(config, "original_max_position_embeddings", None)
                              or config.max_position_embeddings))
        elif kind == "dynamic":
            limits.append(int(config.max_position_embeddings))
    return min(limits) if limits else None


def check_rope(config, up_to_original: bool = False) -> None:
    """Raise a one-line ViasdError unless every RoPE type of `config` is one the engine runs exactly:
    the static types, and with `up_to_original` (a target, whose context then stops at
    `exact_positions`) the length-dependent ones too. An EAGLE head takes the static ones only."""
    supported = STATIC_ROPE_TYPES + (_LENGTH_DEPENDENT if up_to_original else ())
    for rope_type in rope_types(config):
        if rope_type in supported:
            continue
        why = ("its frequencies depend on the current sequence length"
               if any(t in rope_type for t in _LENGTH_DEPENDENT) else "viasd does not know it")
        raise ViasdError(f"RoPE type '{rope_type}' is not supported ({why}); supported: {', '.join(supported)}")


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sine table [..., D] as `apply_rope` takes it: its first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated by the table rows cos, sin [T, D] of its positions, sin given as
    `signed_sin(sin)` (transformers' layout: the pairs (i, i + D/2), `rotate_half`).

    transformers computes x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). That is
    x * cos + roll(x, D/2) * signed_sin(sin): the same products up to a sign, and a sign flip is
    exact, so every value is bit for bit the same (tests/runtime/test_model_rope.py compares it with
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
