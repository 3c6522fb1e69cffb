"""The EAGLE-3 head's checkpoint folder: config and tensor checks, loading and saving, in the
published layout (config.json + model.safetensors; a pickle only when the user allows it)."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from viasd_core.speculation.eagle import CONFIG, EMBED, LAYER_IDS_KEY, PICKLE, SAFETENSORS, FeatureHead, head_llama_config
from viasd_core.speculation.head_layouts import eagle3_tensors, flat_config
from viasd_core.runtime.rope import check_rope
from viasd_core.errors import ViasdError
from viasd_core.paths import atomic_folder


# ---------------------------------------------------------------------- checks
def _int(raw: dict, key: str, where: str, default=None) -> int:
    value = raw.get(key) if raw.get(key) is not None else default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ViasdError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _eagle_config(raw: dict) -> dict:
    """The nested `eagle_config` settings (what SGLang reads), when the config has them."""
    return raw["eagle_config"] if isinstance(raw.get("eagle_config"), dict) else {}


# The config keys that name the target layers a head reads, and what their numbers mean, as
# (where, key, offset): viasd's index (FeatureHead.feature_layers, FastModel.capture_features) is
# the decoder layer whose INPUT is read, transformers' output_hidden_states[i] (0: the embedding
# output), and a key's number n means index n + offset.
#   top-level eagle_aux_hidden_state_layer_ids, offset 0: EAGLE-3 and the speculators layout, as
#       vLLM reads them (gpu_model_runner passes them on as they are; its models keep the residual
#       entering layer i);
#   eagle_config.eagle_aux_hidden_state_layer_ids, offset 1: what SGLang reads; its numbers name
#       the layer whose OUTPUT is read (SGLang's set_eagle3_layers_to_capture adds 1);
#   top-level aux_hidden_states_layer_ids, offset 1: AngelSlim's trainer, which reads
#       hidden_states[id + 1] (target_model_wrapper._extract_auxiliary_hidden_states).
# A config without any leaves the target's default, (2, L//2, L-3) in viasd's index, which EAGLE's,
# vLLM's and SGLang's code all pick (AngelSlim's own Qwen3 inference model hard-codes it too).
LAYER_KEYS = (("top", LAYER_IDS_KEY, 0), ("eagle_config", LAYER_IDS_KEY, 1), ("top", "aux_hidden_states_layer_ids", 1))


@dataclass(frozen=True)
class DeclaredLayers:
    key: str  # as the config spells it (`eagle_config.` prefixed when nested)
    given: list  # the numbers as written
    layers: tuple[int, ...] | None  # viasd's index, in the config's order; None when `given` is not a list of ints


def _reading(d: DeclaredLayers) -> str:
    return f"{d.key} {d.given}" + (f" (inputs of layers {sorted(d.layers)})" if d.layers is not None else "")


def declared_layers(raw: dict, where: str) -> DeclaredLayers | None:
    """The target layers a head's (flat) config names, converted to viasd's index by LAYER_KEYS;
    None when it names none (the default applies). Two keys that name different layers are refused."""
    found = []
    for scope, key, offset in LAYER_KEYS:
        ids = (raw if scope == "top" else _eagle_config(raw)).get(key)
        if ids is None:
            continue
        valid = isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        found.append(DeclaredLayers(key if scope == "top" else f"{scope}.{key}", ids,
                                    tuple(i + offset for i in ids) if valid else None))
    for other in found[1:]:
        if other.layers is None or found[0].layers is None or sorted(other.layers) != sorted(found[0].layers):
            raise ViasdError(f"{where}: {_reading(found[0])} and {_reading(other)} name different target "
                             "layers (vLLM reads the top-level key, SGLang eagle_config's): make them agree in config.json")
    return found[0] if found else None


def feature_layers(raw: dict, n_target_layers: int, where: str) -> tuple[int, int, int]:
    """The three target layers whose input states the head reads, ascending (checked against the target)."""
    declared = declared_layers(raw, where)
    if declared is None:
        ids = [2, n_target_layers // 2, n_target_layers - 3]  # EAGLE's, vLLM's and SGLang's default
        named = f"the default layers (2, L//2, L-3) = {tuple(ids)} of this {n_target_layers}-layer target"
    else:
        ids = declared.layers
        shifted = ids is not None and list(ids) != declared.given
        named = f"{declared.key} {declared.given}" + (f" (layer outputs: the inputs of layers {sorted(ids)})" if shifted else "")
    if ids is None or len(ids) != 3 or len(set(ids)) != 3:
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
    if _eagle_config(raw).get("use_aux_hidden_state") is False:
        raise ViasdError(f"{where}: this head variant (no fused features) is not supported")
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
    return ("draft_vocab_size" in raw or "eagle" in archs or "eagle_config" in raw
            or any(key in raw for scope, key, _ in LAYER_KEYS if scope == "top"))


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
    return flat_config(raw, f"EAGLE-3 head '{folder}'")  # a speculators layout's config, flattened


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
    return eagle3_tensors(tensors)  # a speculators layout's layers.0.* named midlayer.*


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
    with atomic_folder(folder) as tmp:
        save_file(tensors, str(tmp / SAFETENSORS))
        (tmp / CONFIG).write_text(json.dumps(head.config_dict, indent=2) + "\n", encoding="utf-8")
    return folder
