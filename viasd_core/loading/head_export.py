"""`viasd export`: an EAGLE-3 head (trained here by `viasd distill --kind feature`, or any head
viasd loads) written in the layout vLLM or SGLang loads, with the command that serves it.

What each engine reads (from their source; docs/export.md has the list and what was checked):

  eagle3 layout (--to vllm or sglang; one folder both load): config.json with
      architectures ["LlamaForCausalLMEagle3"], tie_word_embeddings false (SGLang ties lm_head to
      embed_tokens otherwise), draft_vocab_size, target_hidden_size, the feature layers twice:
      top-level `eagle_aux_hidden_state_layer_ids` as viasd reads them (the inputs of those
      decoder layers; vLLM's gpu_model_runner takes them as they are) and
      `eagle_config.eagle_aux_hidden_state_layer_ids` one lower (SGLang reads only that one and
      adds 1: `set_eagle3_layers_to_capture`); model.safetensors with `midlayer.*`, fc, norm,
      lm_head, d2t [draft_vocab] int64 (target id - draft index), t2d [vocab] bool.
  speculators layout (--to vllm --layout speculators; vLLM only: SGLang's loader would drop
      `layers.0.*` without a word): head_layouts.speculators_config, `layers.0.*` tensors, the
      chosen draft length as speculative_tokens.

The embedding is never written (both engines share the target's when the file has none).
Training records move to viasd_export.json beside them (provenance, the draft length and why).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from viasd_core import paths
from viasd_core.speculation.eagle import CONFIG, EMBED, LAYER_IDS_KEY, SAFETENSORS, FeatureHead
from viasd_core.speculation.eagle_files import (LAYER_KEYS, check_head_config, check_head_tensors, declared_layers,
                                             read_head_config, read_head_weights)
from viasd_core.speculation.head_layouts import speculators_config, speculators_tensors
from viasd_core.errors import UsageError, ViasdError

ENGINES = ("vllm", "sglang")
LAYOUTS = ("eagle3", "speculators")
RECORD = "viasd_export.json"
DEFAULT_TOKENS = 3  # no measurement: the speculators trainer's default (3 TTT steps) and vLLM's docs' example
MIN_REACH = 0.3  # a drafted position is worth its step while the chain reaches it this often (see draft_length)
MAX_TOKENS = 16
TRAINING_KEYS = ("viasd_training",)


@dataclass
class ExportResult:
    folder: Path
    engine: str
    layout: str
    tokens: int
    tokens_why: str
    command: str
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- the draft length
def measured_agreement(raw: dict) -> tuple[list[float], str] | None:
    """Per-position teacher-forced agreement the head's training measured (draft step 1, 2, ...):
    on the evaluation prompts, else on held-out sequences; None when it measured none."""
    info = raw.get("viasd_training")
    if not isinstance(info, dict):
        return None
    candidates = ((info.get("eval") or {}).get("agreement_by_position"), "evaluation prompts"), \
                 (info.get("held_out_agreement"), "held-out sequences")
    for values, where in candidates:
        if isinstance(values, list) and values and all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in values):
            return [float(v) for v in values], where
    return None


def draft_length(raw: dict) -> tuple[int, str]:
    """num_speculative_tokens from the head's own measurements: the longest chain whose last
    position the target still accepts with probability >= MIN_REACH, where a chain reaches
    position j with probability a_1 * ... * a_j (a_s: step s's measured agreement; greedy
    acceptance). Positions past the measured ones are not guessed. Without a measurement,
    DEFAULT_TOKENS."""
    measured = measured_agreement(raw)
    if measured is None:
        return DEFAULT_TOKENS, f"default {DEFAULT_TOKENS}: the head records no per-position agreement"
    agreement, where = measured
    reach, n = 1.0, 0
    for a in agreement:
        reach *= a
        if reach < MIN_REACH:
            break
        n += 1
    n = max(1, n)
    tau = 1 + sum(_prefix_products(agreement[:n]))
    return n, (f"{n}: the longest chain whose last token is accepted with probability >= {MIN_REACH} "
               f"(agreement by position on {where}: {', '.join(f'{a:.2f}' for a in agreement[: n + 1])}; "
               f"expected {tau:.2f} tokens per target pass)")


def _prefix_products(values: list[float]) -> list[float]:
    out, p = [], 1.0
    for v in values:
        p *= v
        out.append(p)
    return out


# ---------------------------------------------------------------------- checks
def _checked_head(folder: Path, target_config) -> tuple[dict, dict[str, torch.Tensor], tuple[int, int, int] | None]:
    """The head's flat config, its tensors (EAGLE-3 names, maps filled in) and its feature layers
    (None when the config leaves them to the target's default), checked as loading checks them."""
    where = f"EAGLE-3 head '{folder}'"
    raw = read_head_config(folder)
    declared = declared_layers(raw, where)  # every layout's key, in viasd's index (eagle_files.LAYER_KEYS)
    if target_config is None:  # the head's own sizes stand in for the target's
        hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
        top = max(declared.layers) + 1 if declared is not None and declared.layers else 64
        target_config = SimpleNamespace(hidden_size=hidden, vocab_size=raw.get("vocab_size"), num_hidden_layers=top)
    layers = check_head_config(raw, target_config, where)
    tensors = read_head_weights(folder)
    tensors.pop(EMBED, None)  # the engines share the target's embedding
    with torch.device("meta"):
        head = FeatureHead(raw, layers, embed=nn.Identity())
    if head.draft_vocab_size == head.vocab_size:
        tensors.setdefault("d2t", torch.zeros(head.vocab_size, dtype=torch.long))
        tensors.setdefault("t2d", torch.ones(head.vocab_size, dtype=torch.bool))
    check_head_tensors(head, tensors, where)
    tensors["d2t"] = tensors["d2t"].to(torch.long)
    return raw, tensors, (layers if declared is not None else None)


def _target_config(target: str | None):
    """The target's config when `target` is a local model folder (then the head is checked
    against it), else None (the name only goes into the command)."""
    if target is None or not (Path(target).expanduser() / CONFIG).is_file():
        return None
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(Path(target).expanduser()))
    except (OSError, ValueError) as e:
        raise ViasdError(f"--target '{target}': its config.json cannot be read ({str(e).splitlines()[0]})") from None
    return getattr(cfg, "text_config", None) or cfg


# ---------------------------------------------------------------------- the files
def eagle3_config(raw: dict, layers: tuple[int, int, int] | None) -> dict:
    """config.json of the eagle3 layout (module docstring)."""
    # the layer keys are written anew below, in the spellings the engines read (a trainer's own key dropped)
    cfg = {k: v for k, v in raw.items() if k not in TRAINING_KEYS and k != "eagle_config"
           and k not in {key for scope, key, _ in LAYER_KEYS if scope == "top"}}
    cfg.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                "tie_word_embeddings": False,
                "draft_vocab_size": int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                "target_hidden_size": int(raw.get("target_hidden_size") or raw["hidden_size"])})
    if not cfg.get("norm_before_residual"):
        cfg.pop("norm_before_residual", None)
    eagle = {"use_aux_hidden_state": True}
    if layers is not None:
        cfg[LAYER_IDS_KEY] = list(layers)
        if min(layers) >= 1:  # SGLang adds 1 to these; a layer-0 feature (the embeddings) has no SGLang spelling
            eagle[LAYER_IDS_KEY] = [i - 1 for i in layers]
    else:
        cfg.pop(LAYER_IDS_KEY, None)
    cfg["eagle_config"] = eagle
    return cfg


def _refusals(raw: dict, layers, engine: str, layout: str) -> None:
    if layout == "speculators" and engine != "vllm":
        raise UsageError("--layout speculators is read by vLLM only: SGLang's llama_eagle3.py loads midlayer.* "
                         "names and would drop layers.0.* without a word; use --layout eagle3 for sglang")
    if engine == "sglang" and raw.get("norm_before_residual"):
        raise ViasdError("this head takes its residual after hidden_norm (norm_before_residual), which SGLang's "
                         "llama_eagle3.py does not implement: export it --to vllm")
    if engine == "sglang" and layers is not None and min(layers) < 1:
        raise ViasdError(f"this head reads the target's layer-0 input (the embeddings; layers {list(layers)}): SGLang "
                         "captures the inputs of layers 1 and up only (set_eagle3_layers_to_capture adds 1): "
                         "export it --to vllm")


def serve_command(engine: str, out: Path, target: str | None, tokens: int) -> str:
    model = target or "TARGET"
    out_s = str(Path(out).resolve())
    if engine == "vllm":
        spec = json.dumps({"method": "eagle3", "model": out_s, "num_speculative_tokens": tokens}, separators=(",", ":"))
        return f"vllm serve {shlex.quote(model)} --speculative-config {shlex.quote(spec)}"
    return (f"python -m sglang.launch_server --model-path {shlex.quote(model)} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(out_s)} --speculative-num-steps {tokens} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {tokens + 1}")


def check_options(head: str | os.PathLike, engine: str, out: str | os.PathLike, layout: str, tokens: int | None) -> tuple[Path, Path]:
    """Refuse bad options before anything is read: (head folder, out folder)."""
    if engine not in ENGINES:
        raise UsageError(f"unknown --to '{engine}': use {' or '.join(ENGINES)}")
    if layout not in LAYOUTS:
        raise UsageError(f"unknown --layout '{layout}': use {' or '.join(LAYOUTS)}")
    if tokens is not None and not 1 <= tokens <= MAX_TOKENS:
        raise UsageError(f"--tokens must be 1..{MAX_TOKENS} (got {tokens})")
    head, out = Path(head).expanduser(), Path(out).expanduser()
    if not head.is_dir():
        raise UsageError(f"'{head}' is not a folder: give the head's folder (config.json + model.safetensors)")
    out = paths.check_replaceable_dir(out, "OUT_DIR")
    if out.exists() and out.resolve() == head.resolve():
        raise UsageError("OUT_DIR is the head's own folder: give another one")
    if out.is_dir() and any(out.iterdir()) and not (out / RECORD).is_file():
        raise UsageError(f"OUT_DIR '{out}' holds files that are not an earlier export: give a new or empty folder")
    return head, out


def export_head(head: str | os.PathLike, engine: str, out: str | os.PathLike, *, layout: str = "eagle3",
                target: str | None = None, tokens: int | None = None) -> ExportResult:
    """Write the head in `head` for `engine` into `out` (atomically: a temporary folder, then a
    rename); returns what was written and the serve command."""
    from safetensors.torch import save_file

    head, out = check_options(head, engine, out, layout, tokens)
    target_config = _target_config(target)
    raw, tensors, layers = _checked_head(head, target_config)
    _refusals(raw, layers, engine, layout)
    if tokens is not None:
        n, why = tokens, f"{tokens}: given (--tokens)"
    else:
        n, why = draft_length(raw)
    notes = []
    if target is None:
        notes.append("no --target: the command names TARGET; put the target model's id or folder there")
    elif target_config is None:
        notes.append(f"--target '{target}' is not a local folder: the head was not checked against it")
    if layers is None:
        notes.append("the head reads the default layers (2, L//2, L-3); both engines use the same default")
    if layout == "speculators":
        config = speculators_config(raw, list(layers) if layers is not None else None, speculative_tokens=n,
                                    verifier=target, verifier_architectures=list(getattr(target_config, "architectures", None) or []))
        tensors = speculators_tensors(tensors)
    else:
        config = eagle3_config(raw, layers)
    record = {"exported_by": "viasd export", "source": str(head.resolve()), "engine": engine, "layout": layout,
              "target": target, "num_speculative_tokens": n, "why": why,
              "viasd_training": raw.get("viasd_training")}
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    with paths.atomic_folder(out) as tmp:
        save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return ExportResult(out, engine, layout, n, why, serve_command(engine, out, target, n), notes)
