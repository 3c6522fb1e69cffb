"""A lean batch-1 decoder forward with a static KV cache, over a transformers model's weights.

`FastModel` runs the layers of a Hugging Face decoder-only model (Llama, Mistral, Qwen2,
Qwen3, Gemma families) without the framework's per-call machinery: the KV cache is
preallocated once, written at `start`, and attention reads `cache[:start + T]`, so rolling
back after a rejected draft is a length reset (`rollback(n)`), never a copy.

The same class is the **slim verifier**: pass `layer_ids` to run a subset of the layers. It
holds references to the target's modules (embedding, kept layers, norm, lm_head), so it
shares every weight and costs only its own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import ViasdError
from .rope import check_rope

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")


@dataclass(frozen=True)
class ModelShape:
    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int


def model_shape(hf_model) -> ModelShape:
    cfg = hf_model.config
    family = getattr(cfg, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise ViasdError(
            f"model family '{family}' is not supported yet (supported: {', '.join(SUPPORTED_FAMILIES)}); "
            "use a model of one of those families"
        )
    check_rope(cfg)
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return ModelShape(
        family=family,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=hf_model.get_output_embeddings().weight.shape[0],
        max_positions=getattr(cfg, "max_position_embeddings", 4096),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FastModel:
    """Batch-1 forward with a preallocated KV cache over (a subset of) a HF model's layers.

    `seen` is the number of positions whose K/V are valid in the cache. `forward(ids, start)`
    writes positions [start, start + T) and returns logits for the last `n_logits` of them.
    """

    def __init__(self, hf_model, layer_ids: list[int] | None = None, max_len: int = 2048, name: str = "target"):
        self.hf_model = hf_model
        self.shape = model_shape(hf_model)
        self.name = name
        decoder = hf_model.get_decoder()
        self.embed = decoder.embed_tokens
        if self.shape.family == "gemma" and getattr(self.embed, "embed_scale", None) is None:
            raise ViasdError("this Gemma model's embedding has no sqrt(hidden) scale (transformers < 5.4 applies it "
                             "outside the module): upgrade transformers to 5.4 or later")
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        self.lm_head = hf_model.get_output_embeddings()
        all_layers = list(decoder.layers)
        if layer_ids is None:
            layer_ids = list(range(len(all_layers)))
        if not layer_ids or any(not 0 <= i < len(all_layers) for i in layer_ids):
            raise ValueError(f"layer_ids must be non-empty indices below {len(all_layers)}, got {layer_ids}")
        self.layer_ids = sorted(layer_ids)
        self.layers = [all_layers[i] for i in self.layer_ids]
        self.windows = [self._window(layer) for layer in self.layers]
        param = next(hf_model.parameters())
        self.device = param.device
        # Quantized weights (bitsandbytes) report uint8/int8: the activations use the compute dtype.
        self.dtype = param.dtype if param.dtype.is_floating_point else getattr(hf_model, "dtype", torch.float32)
        if not self.dtype.is_floating_point:
            self.dtype = torch.float32
        # bitsandbytes runs a single-token pass through another kernel (gemv) than a multi-token
        # one: on a quantized model every pass covers at least 2 positions (re-feeding a cached
        # one), so plain decoding and block verification compute the same numbers.
        self.min_pass = 2 if getattr(hf_model, "hf_quantizer", None) is not None else 1
        self.max_len = 0
        self.seen = 0
        self.vocab_limit: int | None = None  # logits at columns >= vocab_limit are -inf (None: no mask)
        self.allocate(max_len)

    # ------------------------------------------------------------------ set-up
    def _window(self, layer) -> int | None:
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None)
        if window is None and self.shape.family == "mistral":
            window = getattr(self.hf_model.config, "sliding_window", None)
        return int(window) if window else None

    def allocate(self, max_len: int) -> None:
        """(Re)allocate the KV cache and the RoPE tables for `max_len` positions."""
        max_len = int(max_len)
        if max_len <= self.max_len:
            return
        s = self.shape
        n = len(self.layers)
        kv_shape = (n, 1, s.n_kv_heads, max_len, s.head_dim)
        self.k_cache = torch.zeros(kv_shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(kv_shape, dtype=self.dtype, device=self.device)
        positions = torch.arange(max_len, device=self.device)
        dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = self.rotary(dummy, positions[None])
        self.cos = cos[0].to(self.dtype)  # [max_len, head_dim]
        self.sin = sin[0].to(self.dtype)
        self.positions = positions
        self.max_len = max_len
        self.seen = 0

    def rollback(self, n: int) -> None:
        """Keep the first `n` cached positions; later ones are overwritten by the next forward."""
        self.seen = min(self.seen, n)

    def reset(self) -> None:
        self.seen = 0

    def cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, n_logits: int = 1) -> torch.Tensor:
        """Run positions [start, start + T) and return float32 logits of the last `n_logits`.

        input_ids: [T] int64 on this model's device. Returns [n_logits, vocab] float32.
        """
        T = input_ids.shape[0]
        end = start + T
        if end > self.max_len:
            raise ViasdError(f"context of {end} tokens exceeds the allocated {self.max_len}; raise the context budget")
        if not 0 < n_logits <= T:
            raise ValueError(f"n_logits must be in [1, {T}], got {n_logits}")
        s = self.shape
        x = self.embed(input_ids[None])  # [1, T, H]
        cos = self.cos[start:end]
        sin = self.sin[start:end]
        masks: dict[int | None, torch.Tensor | None] = {}
        for ci, layer in enumerate(self.layers):
            window = self.windows[ci]
            if window not in masks:
                masks[window] = self._mask(start, end, window)
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, T, s.n_heads, s.head_dim)
            k = attn.k_proj(h).view(1, T, s.n_kv_heads, s.head_dim)
            v = attn.v_proj(h).view(1, T, s.n_kv_heads, s.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3
                q = attn.q_norm(q)
                k = attn.k_norm(k)
            q = q.transpose(1, 2)
            k = k.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache = self.k_cache[ci]
            v_cache = self.v_cache[ci]
            k_cache[:, :, start:end] = k
            v_cache[:, :, start:end] = v.transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q,
                k_cache[:, :, :end],
                v_cache[:, :, :end],
                attn_mask=masks[window],
                scale=attn.scaling,
                enable_gqa=s.n_kv_heads != s.n_heads,
            )
            o = attn.o_proj(o.transpose(1, 2).reshape(1, T, s.n_heads * s.head_dim))
            x = x + o
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.seen = end
        h = self.norm(x[0, T - n_logits :])
        logits = self.lm_head(h).float()
        if self.vocab_limit is not None:
            logits[:, self.vocab_limit :] = float("-inf")
        return logits

    def _mask(self, start: int, end: int, window: int | None) -> torch.Tensor | None:
        """Boolean attention mask [T, end] (True = attend), or None when plain causal suffices."""
        T = end - start
        if T == 1 and (window is None or end <= window):
            return None
        q_pos = self.positions[start:end, None]
        k_pos = self.positions[None, :end]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
        return mask

    def extend(self, ids: torch.Tensor, end: int, n_logits: int = 1) -> torch.Tensor:
        """Feed the positions [seen, end) of the token buffer `ids` and return the last logits."""
        # Positions whose logits are wanted but already cached are simply recomputed.
        start = max(0, min(self.seen, end - n_logits, end - self.min_pass))
        return self.forward(ids[start:end], start, n_logits=n_logits)
