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
    hidden   = h + mlp(post_attention_layernorm(h))                      [T, H]  (the next step's feature)
    logits   = lm_head(norm(hidden))                                     [T, draft_vocab], fp32
    target id of draft index j = j + d2t[j]; t2d[v] marks the target ids the head can propose

Checkpoint layout (SafeAILab/EAGLE `eagle/model/cnets.py` and `traineagle3/`, also read by vLLM's and
SGLang's `llama_eagle3.py`): `config.json` is a Llama config of the head (hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads, num_hidden_layers 1, rms_norm_eps, vocab_size = the
target's, draft_vocab_size; rope_theta when present, else transformers' default 10000, which is what
EAGLE's own training used) and optionally `eagle_aux_hidden_state_layer_ids` (top level or under
`eagle_config`); without it the layers are (2, L//2, L-3) of an L-layer target. The weights are one
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

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from viasd_core.errors import ViasdError
from viasd_core.decoding import attention
from viasd_core.decoding.rope import apply_rope, check_rope

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
        if embed is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.__dict__["target_embed"] = embed
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.max_len = 0
        self.seen = 0  # positions whose K/V are valid in the cache

    # ------------------------------------------------------------------ set-up
    @property
    def embedding(self) -> nn.Module:
        shared = self.__dict__.get("target_embed")
        return shared if shared is not None else self.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def allocate(self, max_len: int) -> None:
        """Allocate the one layer's KV cache and the RoPE tables for `max_len` positions (empties the cache)."""
        cfg, device = self.llama_config, self.fc.weight.device
        positions = torch.arange(max_len, device=device)
        with torch.no_grad():
            cos, sin = LlamaRotaryEmbedding(cfg)(self.fc.weight, positions[None])
        self.register_buffer("rope_cos", cos[0].to(self.dtype), persistent=False)  # [max_len, D]
        self.register_buffer("rope_sin", sin[0].to(self.dtype), persistent=False)
        self.cache = attention.LayerCache(cfg.num_key_value_heads, max_len, cfg.head_dim, self.dtype, device)
        self.max_len = int(max_len)
        self.seen = 0

    # ------------------------------------------------------------------ forward
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's three layer states [T, 3H] -> one feature [T, H]."""
        return self.fc(features.to(self.dtype))

    def to_target_ids(self, draft_idx: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary indices -> target token ids (same shape)."""
        return draft_idx + self.d2t[draft_idx]

    def qkv(self, emb: torch.Tensor, fused: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The layer's attention inputs: emb, fused [B, T, H] -> q [B, heads, T, D], k, v [B, kv_heads, T, D],
        RoPE applied (cos, sin [T, D]). Shared by drafting (one cache) and training (eagle_train)."""
        cfg = self.llama_config
        B, T = emb.shape[:2]
        layer, attn = self.midlayer, self.midlayer.self_attn
        x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(fused)), dim=-1)  # [B, T, 2H]
        q = attn.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, fused: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual and MLP after attention: the head's output feature [..., H]."""
        layer = self.midlayer
        h = fused + layer.self_attn.o_proj(attn_out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (float32) of output features."""
        return self.lm_head(self.norm(hidden)).float()

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
        fused = self.fuse(features) if features.shape[-1] != self.hidden_size else features.to(self.dtype)
        emb = self.embedding(token_ids).to(self.dtype)
        q, k, v = self.qkv(emb[None], fused[None], self.rope_cos[start:end], self.rope_sin[start:end])
        pos = torch.arange(start, end, device=token_ids.device)
        k_cache, v_cache = self.cache.update(pos, k, v)
        mask = attention.causal_mask(pos, torch.arange(end, device=pos.device)) if T > 1 else None  # [T, end]
        o = attention.attend(q, k_cache[:, :, :end], v_cache[:, :, :end], mask)  # [1, T, heads * D]; scale 1/sqrt(D)
        hidden = self.finish(fused, o[0])
        rows = hidden if n_logits is None else hidden[T - n_logits:]
        logits = self.logits(rows)
        self.seen = end
        return logits, hidden


# ---------------------------------------------------------------------- checks
def _int(raw: dict, key: str, where: str, default=None) -> int:
    value = raw.get(key) if raw.get(key) is not None else default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ViasdError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _eagle_config(raw: dict) -> dict:
    """vLLM's nested `eagle_config` settings, when the config has them."""
    return raw["eagle_config"] if isinstance(raw.get("eagle_config"), dict) else {}


def feature_layers(raw: dict, n_target_layers: int, where: str) -> tuple[int, int, int]:
    """The three target layers whose input states the head reads, ascending (checked against the target)."""
    ids = raw.get(LAYER_IDS_KEY, _eagle_config(raw).get(LAYER_IDS_KEY))
    if ids is None:
        ids = [2, n_target_layers // 2, n_target_layers - 3]  # EAGLE's and vLLM's default
        named = f"the default layers (2, L//2, L-3) = {tuple(ids)} of this {n_target_layers}-layer target"
    else:
        named = f"{LAYER_IDS_KEY} {ids}"
    if (not isinstance(ids, list) or len(ids) != 3 or any(not isinstance(i, int) or isinstance(i, bool) for i in ids)
            or len(set(ids)) != 3):
        raise ViasdError(f"{where}: {named} are not three distinct layer indices (set {LAYER_IDS_KEY} in config.json)")
    if any(not 0 <= i < n_target_layers for i in ids):
        raise ViasdError(f"{where}: {named} are out of range: the target has {n_target_layers} layers (0..{n_target_layers - 1})")
    return tuple(sorted(ids))


def check_head_config(raw: dict, target_config, where: str) -> tuple[int, int, int]:
    """Refuse a head config that does not fit `target_config`; returns its feature layers."""
    hidden = _int(raw, "hidden_size", where)
    target_hidden = int(target_config.hidden_size)
    if hidden != target_hidden or raw.get("target_hidden_size", hidden) != target_hidden:
        raise ViasdError(f"{where}: hidden size {raw.get('target_hidden_size', hidden)} does not match the target's "
                         f"{target_hidden}: this head was made for another model")
    vocab = _int(raw, "vocab_size", where)
    if vocab != int(target_config.vocab_size):
        raise ViasdError(f"{where}: vocab size {vocab} does not match the target's {target_config.vocab_size}: "
                         "this head was made for another tokenizer")
    draft_vocab = _int(raw, "draft_vocab_size", where, default=vocab)
    if draft_vocab > vocab:
        raise ViasdError(f"{where}: draft_vocab_size {draft_vocab} exceeds the vocabulary of {vocab}")
    if _int(raw, "num_hidden_layers", where, default=1) != 1:
        raise ViasdError(f"{where}: {raw['num_hidden_layers']} decoder layers; only one-layer EAGLE-3 heads are supported")
    if raw.get("norm_before_residual") or _eagle_config(raw).get("use_aux_hidden_state") is False:
        raise ViasdError(f"{where}: this head variant (norm_before_residual, or no fused features) is not supported")
    for key in ("intermediate_size", "num_attention_heads"):
        _int(raw, key, where)
    try:
        cfg = head_llama_config(raw)
    except (TypeError, ValueError) as e:
        raise ViasdError(f"{where}: not a valid Llama config ({str(e).splitlines()[0]})") from None
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ViasdError(f"{where}: {cfg.num_attention_heads} heads are not a multiple of {cfg.num_key_value_heads} KV heads")
    check_rope(cfg)
    return feature_layers(raw, int(target_config.num_hidden_layers), where)


def is_feature_head_folder(folder: str | os.PathLike) -> bool:
    """True when `folder` holds an EAGLE-3 head (its config names a draft vocabulary or Eagle3, or
    the feature layers), not a causal LM."""
    try:
        raw = json.loads((Path(folder) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    archs = " ".join(str(a) for a in raw.get("architectures") or []).lower()
    return "draft_vocab_size" in raw or "eagle" in archs or LAYER_IDS_KEY in raw or "eagle_config" in raw


def read_head_config(folder: Path) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        raise ViasdError(f"'{folder}' has no {CONFIG}: it is not an EAGLE-3 head folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ViasdError(f"{path} is not valid JSON ({getattr(e, 'msg', e)}): the file is damaged") from None
    if not isinstance(raw, dict):
        raise ViasdError(f"{path} is not a JSON object")
    return raw


def read_head_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of `model.safetensors`, else of `pytorch_model.bin` (plain tensors only: weights_only)."""
    safetensors_path, pickle_path = folder / SAFETENSORS, folder / PICKLE
    if safetensors_path.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(safetensors_path))
        except (SafetensorError, OSError, ValueError) as e:
            raise ViasdError(f"{safetensors_path} is damaged or truncated ({str(e).splitlines()[0]})") from None
    elif pickle_path.is_file():
        try:
            tensors = torch.load(pickle_path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise ViasdError(f"{pickle_path} holds objects other than tensors: refused (it is read with "
                             "weights_only=True, so it cannot run code)") from None
        except Exception as e:  # a truncated or foreign file: torch raises several kinds
            raise ViasdError(f"{pickle_path} is damaged or not a PyTorch file ({type(e).__name__})") from None
    else:
        raise ViasdError(f"'{folder}' has no {SAFETENSORS} or {PICKLE}: copy the head's weights there")
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ViasdError(f"the weights in '{folder}' are not a flat mapping of names to tensors")
    return tensors


def _names(names) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_head_tensors(head: FeatureHead, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse missing, unexpected, mistyped or misshapen tensors, and vocabulary maps that disagree."""
    expected = head.state_dict()
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing:
        raise ViasdError(f"{where}: missing tensors {_names(missing)}")
    if unexpected:
        raise ViasdError(f"{where}: unexpected tensors {_names(unexpected)} (not the EAGLE-3 layout)")
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape:
            raise ViasdError(f"{where}: tensor '{name}' has shape {list(got.shape)}, expected {list(want.shape)}")
        kind_ok = {"d2t": not got.dtype.is_floating_point and got.dtype != torch.bool,
                   "t2d": got.dtype == torch.bool}.get(name, got.dtype.is_floating_point)
        if not kind_ok:
            raise ViasdError(f"{where}: tensor '{name}' has dtype {got.dtype}, expected {want.dtype}")
    target_ids = torch.arange(head.draft_vocab_size) + tensors["d2t"].long()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= head.vocab_size or target_ids.unique().numel() != target_ids.numel():
        raise ViasdError(f"{where}: d2t maps draft ids outside the target vocabulary or two of them to one id")
    marked = torch.zeros(head.vocab_size, dtype=torch.bool)
    marked[target_ids] = True
    if not torch.equal(marked, tensors["t2d"]):
        raise ViasdError(f"{where}: t2d does not mark exactly the target ids that d2t maps to")


# ---------------------------------------------------------------------- load / save
def load_feature_head(folder: str | os.PathLike, target_config, *, embed: nn.Module | None = None,
                      dtype: torch.dtype | None = None, device=None, max_len: int = 2048) -> FeatureHead:
    """Load an EAGLE-3 head in the published layout for a target with `target_config`.

    `embed`: the target's input embedding, required when the checkpoint has none (the usual case).
    dtype/device default to the embedding's (else the stored dtype, on CPU). Every mismatch is a
    one-line ViasdError naming it.
    """
    folder = Path(folder)
    where = f"EAGLE-3 head '{folder}'"
    raw = read_head_config(folder)
    layers = check_head_config(raw, target_config, where)
    tensors = read_head_weights(folder)
    own_embed = EMBED in tensors
    if not own_embed and embed is None:
        raise ViasdError(f"{where} has no {EMBED}: pass the target's input embedding (embed=...)")
    with torch.device("meta"):  # shapes only: no memory, no random initialization
        head = FeatureHead(raw, layers, embed=None if own_embed else embed)
    if head.draft_vocab_size == head.vocab_size:  # the maps are optional for a full-vocabulary head
        tensors.setdefault("d2t", torch.zeros(head.vocab_size, dtype=torch.long))
        tensors.setdefault("t2d", torch.ones(head.vocab_size, dtype=torch.bool))
    check_head_tensors(head, tensors, where)
    tensors["d2t"] = tensors["d2t"].long()
    head.load_state_dict(tensors, strict=True, assign=True)
    ref = None if own_embed else embed.weight
    dtype = dtype or (ref.dtype if ref is not None else tensors["fc.weight"].dtype)
    device = device if device is not None else (ref.device if ref is not None else "cpu")
    head.to(device=device, dtype=dtype)
    head.requires_grad_(False).eval()
    head.allocate(max_len)
    return head


def save_feature_head(head: FeatureHead, folder: str | os.PathLike) -> Path:
    """Write `head` in the published layout (config.json, model.safetensors), atomically:
    a temporary folder beside `folder`, then a rename (an existing folder is replaced)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    old = folder.with_name(f".{folder.name}.old")
    try:
        save_file(tensors, str(tmp / SAFETENSORS))
        (tmp / CONFIG).write_text(json.dumps(head.config_dict, indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it private
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return folder
