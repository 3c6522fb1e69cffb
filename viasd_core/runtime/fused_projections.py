"""A decoder layer's projections that read the same input, as one call each: q, k and v; gate and up.

A 1-token pass of a small model on a CPU spends much of its time around its matrix products rather
than in them: calls, dispatch, and threads woken for a product of 192 outputs. gpt-fast fuses
q, k and v into one weight for the same reason. Here the layers stay the model's own: for int8 and
int4 on a CPU, `weight_formats.fuse_rows` concatenates the packed rows once and the original layers
view them (no weight held twice), and FastModel's pass calls the fused layer and splits its output.
Each output is computed exactly as the original layer computes it (tests/runtime/test_fused_projections.py
compares the pass bit for bit with fusion off), so exactness and transformers' own forward (bench's
baselines, fidelity) are unchanged. On SmolLM2 int4 (2 threads), 30 layers' q/k/v/gate/up products
for one row took 5.33 ms as five calls and 3.73 ms as two (docs/experiments/fused-projections-int4.md).

Float layers are left as they are (float32 short passes have their own product: short_products.py;
their weights may be trained and saved, and a saved tensor must not view another). One fusion per
layer, shared by every FastModel over it (a slim view runs the target's layers).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from viasd_core.runtime.weight_formats import fuse_rows

@dataclass(frozen=True)
class Fused:
    qkv: torch.nn.Module | None  # q, k, v side by side (None: not fused)
    qkv_split: tuple[int, int, int]
    gate_up: torch.nn.Module | None  # gate, up side by side (None: not fused)
    gate_up_split: tuple[int, int]


_fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder layer -> Fused


def fused(layer: torch.nn.Module) -> Fused | None:
    """The layer's fused projections (made once per layer), or None where nothing fuses."""
    if layer not in _fused:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):  # Phi-3: the checkpoint's own fused layers (layer_calls splits them)
            _fused[layer] = None
            return None
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv = fuse_rows(parts)
        split = tuple(p.out_features for p in parts)
        gate_up, gu_split = None, (0, 0)
        if all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "act_fn")):
            gate_up = fuse_rows([mlp.gate_proj, mlp.up_proj])
            gu_split = (mlp.gate_proj.out_features, mlp.up_proj.out_features)
        _fused[layer] = Fused(qkv, split, gate_up, gu_split) if qkv is not None or gate_up is not None else None
    return _fused[layer]
