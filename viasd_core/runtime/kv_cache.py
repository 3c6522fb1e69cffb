"""The static KV cache of a FastModel (model.py): every run layer's K/V and the RoPE tables, allocated once."""

from __future__ import annotations

import torch

from viasd_core.runtime import attention
from viasd_core.runtime.rope import signed_sin


class StaticCache(torch.nn.Module):
    """Every run layer's K/V and the RoPE tables, allocated once: `cos`, `sin_signed` the first
    table, `cos_1`, `sin_signed_1`, ... any other (families.rope_tables: Gemma 3's sliding layers)."""

    def __init__(self, n_layers: int, n_kv_heads: int, length: int, head_dim: int, tables, dtype, device):
        super().__init__()
        self.layers = torch.nn.ModuleList(attention.LayerCache(n_kv_heads, length, head_dim, dtype, device)
                                          for _ in range(n_layers))
        for i, (cos, sin) in enumerate(tables):
            tail = f"_{i}" if i else ""
            self.register_buffer("cos" + tail, cos, persistent=False)  # [length, rotary dim]
            self.register_buffer("sin_signed" + tail, signed_sin(sin), persistent=False)  # as apply_rope takes it
        self.tables = len(tables)
        self.register_buffer("key_pos", torch.arange(length, device=device), persistent=False)
        self.register_buffer("features", None, persistent=False)  # [length, n * hidden] once features are captured
