"""The EAGLE-3 draft head (a feature-level draft): its architecture and its published checkpoint layout.

A head reads the target's hidden features instead of only tokens. For the committed token at
position i it takes three of the target's residual-stream states (the inputs of decoder layers
`feature_layers`, i.e. transformers' `output_hidden_states[l]`, concatenated in ascending layer
order: [3H]), fuses them with `fc` ([3H] -> [H]), and runs ONE decoder layer on
[embedding of token i+1; fused feature] (2H wide) to predict token i+2 over a reduced vocabulary.
It then drafts on: its own output feature (before the final norm) replaces the target's.

    fused    = fc(features)                                              [T, H]
    x        = cat(input_layernorm(embed(token)), hidden_norm(fused))    [T, 2H]
    h        = fused + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   (RoPE, causal, own KV cache)
               (norm_before_residual, the speculators variant: hidden_norm(fused) + ...)
    hidden   = h + mlp(post_attention_layernorm(h))                      [T, H]  (the next step's feature)
    logits   = lm_head(norm(hidden))                                     [T, draft_vocab], fp32
    target id of draft index j = j + d2t[j]; t2d[v] marks the target ids the head can propose

Checkpoint layout (SafeAILab/EAGLE `eagle/model/cnets.py` and `traineagle3/`, also read by vLLM's and
SGLang's `llama_eagle3.py`): `config.json` is a Llama config of the head (hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads, num_hidden_layers 1, rms_norm_eps, vocab_size = the
target's, draft_vocab_size; rope_theta when present, else transformers' default 10000, which is what
EAGLE's own training used) and optionally the target layers it reads: top-level
`eagle_aux_hidden_state_layer_ids` (layer inputs, as here), `eagle_config.eagle_aux_hidden_state_layer_ids`
(SGLang's: layer outputs) or `aux_hidden_states_layer_ids` (AngelSlim's trainer: layer outputs), each
converted by eagle_files.LAYER_KEYS; without any, the layers are (2, L//2, L-3) of an L-layer target. The weights are one
`model.safetensors` or `pytorch_model.bin` holding exactly the tensors of `FeatureHead.state_dict()`:
`fc.weight` [H, 3H]; `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight` [H];
`midlayer.self_attn.{q,k,v}_proj.weight` [heads*D, 2H]; `midlayer.self_attn.o_proj.weight`;
`midlayer.mlp.{gate,up,down}_proj.weight`; `norm.weight` [H]; `lm_head.weight` [draft_vocab, H];
`d2t` [draft_vocab] int64; `t2d` [vocab] bool (both may be absent when draft_vocab == vocab). The
embedding is normally absent (EAGLE's trainer freezes it and saves only trained weights): the head
then shares the target's embedding module; an `embed_tokens.weight` [vocab, H] is used when present.

Like `FastModel`: batch 1, a static KV cache, `rollback(n)` keeps n positions, attention.py's attention, fp32 logits.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from viasd_core.errors import ViasdError
from viasd_core.runtime import attention, graph_outputs
from viasd_core.speculation import head_calls
from viasd_core.speculation.head_calls import HeadCalls
from viasd_core.runtime.rope import apply_rope, signed_sin
from viasd_core.runtime.short_products import DEFAULT, ShortRows, as_short_rows
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import apply_weight_format

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
PICKLE = "pytorch_model.bin"
EMBED = "embed_tokens.weight"
LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def head_llama_config(raw: dict):
    """The transformers LlamaConfig of a head's config.json (its own RoPE, heads, MLP)."""
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "eagle_config")}
    return LlamaConfig(**kwargs)


class _SelfAttention(nn.Module):
    """A Llama attention whose q/k/v read [embedding; feature], 2H wide."""

    def __init__(self, cfg):
        super().__init__()
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # of the embedding
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # of the fused feature
        self.self_attn = _SelfAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)


class FeatureHead(nn.Module, attention.CachedPositions):
    """An EAGLE-3 head; its `state_dict()` names are the published checkpoint's.

    `embed`: the target's input-embedding module, shared (not a submodule: never saved, moved or
    cast with the head). Without it the head owns an `embed_tokens` (saved as `embed_tokens.weight`).
    Call `allocate(max_len)` before `forward` (`load_feature_head` does).
    """

    def __init__(self, raw_config: dict, feature_layers: tuple[int, int, int], embed: nn.Module | None = None):
        super().__init__()
        self.config_dict = dict(raw_config)  # written back unchanged by save_feature_head
        self.llama_config = cfg = head_llama_config(raw_config)
        self.feature_layers = tuple(feature_layers)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.draft_vocab_size = int(raw_config.get("draft_vocab_size") or cfg.vocab_size)
        self.norm_before_residual = bool(raw_config.get("norm_before_residual"))  # residual after hidden_norm (speculators)
        if embed is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.__dict__["target_embed"] = embed
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, self.draft_vocab_size, bias=False)
        self.short_rows = DEFAULT  # which product float32 short passes take (short_products.ShortRows)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.max_len = 0
        self.seen = 0  # positions whose K/V are valid in the cache
        self._compiled_step = None  # the drafting step compiled (compile()), else eager
        self._compiled_rows = None  # a token tree's level compiled (compile()), else eager
        self.compile_mode: str | None = None

    # ------------------------------------------------------------------ set-up
    @property
    def embedding(self) -> nn.Module:
        shared = self.__dict__.get("target_embed")
        return shared if shared is not None else self.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def pack_products(self, fmt: WeightFormat) -> None:
        """The layer's and the output head's products in `fmt` (int8 or int4, weight_formats), in
        place; `fc` stays as it is (its weight gives the head's dtype and device)."""
        apply_weight_format(self, fmt, keep=("fc",))
        self._bind_calls()

    @property
    def pass_rows(self) -> ShortRows:
        """The products float32 short passes take, as layer_calls' bound products read it at the call."""
        return as_short_rows(self.short_rows)

    def _bind_calls(self) -> None:
        """The eager and the traced calls (head_calls.bind), made again whenever a weight may have
        been replaced: at `allocate`, after packing, a cast or a move (`_apply`). The eager norms'
        kernels bind the weights as they are now (a 1-token step 346 -> 292 us on a CPU)."""
        self.__dict__["eager_calls"] = head_calls.bind(self, traced=False)
        self.__dict__["traced_calls"] = head_calls.bind(self, traced=True)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if "eager_calls" in self.__dict__:  # bound before this cast or move: bind the new weights
            self._bind_calls()
        return out

    def allocate(self, max_len: int) -> None:
        """Allocate the one layer's KV cache and the RoPE tables for `max_len` positions (empties the cache)."""
        cfg, device = self.llama_config, self.fc.weight.device
        positions = torch.arange(max_len, device=device)
        with torch.no_grad():
            cos, sin = LlamaRotaryEmbedding(cfg)(self.fc.weight, positions[None])
        self.register_buffer("rope_cos", cos[0].to(self.dtype), persistent=False)  # [max_len, D]
        self.register_buffer("rope_sin_signed", signed_sin(sin[0].to(self.dtype)), persistent=False)  # apply_rope's form
        self.cache = attention.LayerCache(cfg.num_key_value_heads, max_len, cfg.head_dim, self.dtype, device)
        self.max_len = int(max_len)
        self._bind_calls()
        self.seen = 0
        if self._compiled_step is not None:  # new buffers: a new graph
            self.compile(self.compile_mode)

    # ------------------------------------------------------------------ forward
    def fuse(self, features: torch.Tensor, calls: HeadCalls | None = None) -> torch.Tensor:
        """The target's three layer states [T, 3H] -> one feature [T, H]. `calls`, here and below:
        the set the pass runs with (head_calls), by default the traced one (PyTorch's operators:
        training, whose autograd the kernels lack)."""
        return (calls or self.traced_calls).fc(features.to(self.dtype))

    def to_target_ids(self, draft_idx: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary indices -> target token ids (same shape)."""
        return draft_idx + self.d2t[draft_idx]

    def qkv(self, emb: torch.Tensor, fused: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            calls: HeadCalls | None = None):
        """The layer's attention inputs: emb, fused [B, T, H] -> q [B, heads, T, D], k, v [B, kv_heads, T, D],
        RoPE applied (cos, sin [T, D], sin as rope.signed_sin makes it). Shared by drafting (one cache) and training (eagle_ttt)."""
        c = calls or self.traced_calls
        cfg = self.llama_config
        B, T = emb.shape[:2]
        x = torch.cat((c.input_norm(emb), c.hidden_norm(fused)), dim=-1)  # [B, T, 2H]
        q = c.q(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = c.k(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = c.v(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, fused: torch.Tensor, attn_out: torch.Tensor, calls: HeadCalls | None = None) -> torch.Tensor:
        """The residual and MLP after attention: the head's output feature [..., H]."""
        c = calls or self.traced_calls
        h = (c.hidden_norm(fused) if self.norm_before_residual else fused) + c.o(attn_out)
        return h + c.mlp(c.post_norm(h))

    def logits(self, hidden: torch.Tensor, calls: HeadCalls | None = None) -> torch.Tensor:
        """Draft-vocabulary logits (float32) of output features."""
        c = calls or self.traced_calls
        return c.lm_head(c.final_norm(hidden)).float()

    # ------------------------------------------------------------------ the compiled drafting step
    def compile(self, mode: str | None = "default") -> bool:
        """torch.compile the 1-token drafting step (static shapes: it attends over the whole cache,
        masked by position; CUDA graphs on CUDA). Catch-up passes over several positions stay eager."""
        if mode == "default" and self.fc.weight.device.type == "cuda":
            mode = "reduce-overhead"
        self.compile_mode = mode
        fn = torch.compile(self._traced_step, fullgraph=True, dynamic=False, mode=mode)
        self._compiled_step = graph_outputs.guard(fn, static=list(self.cache.buffers()))
        rows = torch.compile(self._traced_rows, fullgraph=True, dynamic=False, mode=mode)
        self._compiled_rows = graph_outputs.guard(rows, static=list(self.cache.buffers()))
        return True

    @property
    def compiled(self) -> bool:
        return self._compiled_step is not None

    def warm_up(self) -> float:
        """Compile the drafting step now (it runs at position 0; the cache is emptied after)."""
        if self._compiled_step is None:
            return 0.0
        t0 = time.perf_counter()
        device = self.fc.weight.device
        self._compiled_step(torch.zeros(1, dtype=torch.long, device=device),
                            torch.zeros(1, self.hidden_size, dtype=self.dtype, device=device),
                            torch.zeros(1, dtype=torch.long, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.reset()
        return time.perf_counter() - t0

    def warm_up_rows(self, k: int) -> float:
        """Compile a tree level of `k` rows now (at slots 0..k-1; the cache is emptied after)."""
        if self._compiled_rows is None:
            return 0.0
        t0 = time.perf_counter()
        device = self.fc.weight.device
        slots = torch.arange(k, device=device)
        mask = slots[:, None] == torch.arange(self.max_len, device=device)[None, :]
        self._compiled_rows(torch.zeros(k, dtype=torch.long, device=device),
                            torch.zeros(k, self.hidden_size, dtype=self.dtype, device=device), slots, slots, mask)
        self.reset()
        return time.perf_counter() - t0

    def _traced_step(self, token_id: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """One drafted token at position pos [1] from the head's own previous feature hidden [1, H]:
        (logits [1, draft_vocab] float32, hidden [1, H]), as torch.compile traces it (the traced
        calls, read when traced). Static shapes: every key of the cache, those after pos masked, so
        one graph serves every position."""
        mask = attention.causal_mask(pos, torch.arange(self.max_len, device=pos.device))  # [1, max_len]
        return self._rows(token_id, hidden, pos, pos, mask, self.traced_calls)

    def _traced_rows(self, token_ids: torch.Tensor, hidden: torch.Tensor, rope_pos: torch.Tensor, slots: torch.Tensor,
                     key_mask: torch.Tensor):
        """`_rows` as torch.compile traces it (the traced calls)."""
        return self._rows(token_ids, hidden, rope_pos, slots, key_mask, self.traced_calls)

    def _rows(self, token_ids: torch.Tensor, hidden: torch.Tensor, rope_pos: torch.Tensor, slots: torch.Tensor,
              key_mask: torch.Tensor, calls: HeadCalls):
        """K drafted rows at once: tokens [K] with the features they read hidden [K, H], at RoPE
        positions rope_pos [K], written at cache slots slots [K], row i attending the slots
        key_mask[i] marks ([K, max_len]). Returns (logits [K, draft_vocab] float32, hidden [K, H])."""
        emb = self.embedding(token_ids).to(self.dtype)
        q, k, v = self.qkv(emb[None], hidden[None], self.rope_cos[rope_pos], self.rope_sin_signed[rope_pos], calls)
        k_cache, v_cache = self.cache.update(slots, k, v)
        out = self.finish(hidden, attention.attend(q, k_cache, v_cache, key_mask)[0], calls)
        return self.logits(out, calls), out

    @torch.inference_mode()
    def tree_rows(self, token_ids: torch.Tensor, hidden: torch.Tensor, rope_pos: torch.Tensor, slots: torch.Tensor,
                  key_mask: torch.Tensor):
        """One level of a token tree (tree.py): `_rows`, compiled when the head is (one graph per K).
        The rows' slots lie past `seen`: the cache's committed positions are untouched."""
        if self._compiled_rows is not None:
            logits, out = self._compiled_rows(token_ids, hidden.to(self.dtype), rope_pos, slots, key_mask)
        else:
            logits, out = self._rows(token_ids, hidden.to(self.dtype), rope_pos, slots, key_mask, self.eager_calls)
        return logits, out.clone()  # a compiled call's next run may overwrite its outputs (CUDA graphs)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, start: int,
                n_logits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run positions [start, start + T): `token_ids` [T] with `features` [T, 3H] (the target's) or
        [T, H] (already fused, or this head's own previous output).

        Returns (logits [n_logits or T, draft_vocab] float32 of the last rows, hidden [T, H]).
        """
        T = token_ids.shape[0]
        end = start + T
        if end > self.max_len:
            raise ViasdError(f"context of {end} tokens exceeds the {self.max_len} positions allocated for the "
                             "EAGLE-3 head: raise --max-context or shorten the prompt")
        if start > self.seen:
            raise ValueError(f"start {start} leaves a gap after the {self.seen} cached positions")
        if features.shape[0] != T or features.shape[-1] not in (self.hidden_size, 3 * self.hidden_size):
            raise ValueError(f"features must be [{T}, {self.hidden_size}] or [{T}, {3 * self.hidden_size}], "
                             f"got {list(features.shape)}")
        if self._compiled_step is not None and T == 1 and features.shape[-1] == self.hidden_size:
            pos = torch.full((1,), start, dtype=torch.long, device=token_ids.device)
            logits, hidden = self._compiled_step(token_ids, features.to(self.dtype), pos)
            self.seen = end
            return logits, hidden
        calls = self.eager_calls
        fused = self.fuse(features, calls) if features.shape[-1] != self.hidden_size else features.to(self.dtype)
        emb = self.embedding(token_ids).to(self.dtype)
        q, k, v = self.qkv(emb[None], fused[None], self.rope_cos[start:end], self.rope_sin_signed[start:end], calls)
        pos = torch.arange(start, end, device=token_ids.device)
        k_cache, v_cache = self.cache.update(pos, k, v)
        mask = attention.causal_mask(pos, torch.arange(end, device=pos.device)) if T > 1 else None  # [T, end]
        o = attention.attend(q, k_cache[:, :, :end], v_cache[:, :, :end], mask)  # [1, T, heads * D]; scale 1/sqrt(D)
        hidden = self.finish(fused, o[0], calls)
        rows = hidden if n_logits is None else hidden[T - n_logits:]
        logits = self.logits(rows, calls)
        self.seen = end
        return logits, hidden
