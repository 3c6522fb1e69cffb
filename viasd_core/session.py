"""From command-line options to a ready Engine: target, draft, slim verifier, profile."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from viasd_core import paths
from viasd_core.decoding.drafters import ChainDrafter, HybridDrafter, ModelDrafter, NgramDrafter
from viasd_core.decoding.engine import Engine
from viasd_core.decoding.feature_drafter import FeatureDrafter
from viasd_core.errors import UsageError, ViasdError
from viasd_core.loading.models import EMBEDDED_TARGET, Loaded, check_same_vocab, eos_ids, load_model
from viasd_core.devices import free_memory_bytes, resolve_device
from viasd_core.decoding.model import FastModel
from viasd_core.loading.profile import Profile, find_profile
from viasd_core.decoding.router import Thresholds
from viasd_core.decoding.slim_view import TARGET_WEIGHTS, slim_verifier, twin_bytes
from viasd_core.decoding.weight_formats import default_quant

EMBEDDED_DRAFT = "embedded:smollm2-135m-draft"  # the distilled 2-layer draft model
EMBEDDED_HEAD = "embedded:smollm2-135m-eagle3"  # the EAGLE-3 head trained by viasd (the default)
HYBRID_SUFFIX = "+ngram"  # REF+ngram: prompt lookup where the context repeats, the model draft elsewhere
_EMBEDDED_DRAFT_ALIASES = {EMBEDDED_DRAFT, "smollm2-135m-draft"}
_EMBEDDED_HEAD_ALIASES = {EMBEDDED_HEAD, "smollm2-135m-eagle3"}


@dataclass
class ModelOptions:
    model: str = EMBEDDED_TARGET
    draft: str | None = None  # None/'auto', 'ngram', 'none', a model reference
    revision: str | None = None
    dtype: str | None = None
    device: str | None = None
    quant: str = "auto"  # auto: int4 for the embedded target on CPU (weight_formats.default_quant), else none
    draft_quant: str = "none"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    profile: str | None = None
    max_context: int | None = None  # positions every KV cache holds (None: sized from model and memory)
    compile: str = "auto"  # auto (on for CUDA), on, off


COMPILE_CHOICES = ("auto", "on", "off")
DEFAULT_CONTEXT_CAP = 4096  # the default --max-context never exceeds this (raise it explicitly)


@dataclass
class Session:
    engine: Engine
    target: Loaded
    draft_id: str  # 'ngram', 'none' or the draft model's id
    draft: Loaded | None
    profile: Profile | None
    options: ModelOptions
    compile_seconds: float | None = None  # time spent compiling at start-up (None: eager)

    @property
    def tokenizer(self):
        return self.target.tokenizer


def _draft_ref(opts: ModelOptions, target: Loaded) -> str:
    ref = (opts.draft or "auto").strip()
    if ref != "auto":
        return ref
    if target.model_id == EMBEDDED_TARGET:
        from viasd_core.loading.draft_model import embedded_draft_dir

        # The best measured draft first (docs/benchmarks.md); prompt lookup covers copied text.
        for ref, name in ((EMBEDDED_HEAD, "smollm2-135m-eagle3"), (EMBEDDED_DRAFT, "smollm2-135m")):
            if (embedded_draft_dir(name) / "model.safetensors").exists():
                return ref + HYBRID_SUFFIX
        return "ngram"
    from viasd_core.loading.catalog import draft_for
    from viasd_core.loading.hub import is_cached

    candidate = draft_for(target.model_id)
    if candidate and is_cached(candidate):
        return candidate
    return "ngram"


def load_drafter(opts: ModelOptions, target: Loaded, target_fast: FastModel, progress=None):
    """The drafter for the options: (drafter or None, draft id, Loaded or None)."""
    ref = _draft_ref(opts, target)
    if ref.endswith(HYBRID_SUFFIX) and ref != HYBRID_SUFFIX:
        drafter, draft_id, draft = load_drafter(ModelOptions(**{**opts.__dict__, "draft": ref[: -len(HYBRID_SUFFIX)]}),
                                                target, target_fast, progress)
        if not isinstance(drafter, ChainDrafter):
            raise UsageError(f"'{ref}': the {HYBRID_SUFFIX} suffix goes after a draft model")
        return HybridDrafter(drafter), draft_id + HYBRID_SUFFIX, draft
    vocab = target_fast.shape.vocab_size
    if ref == "none":
        return None, "none", None
    if ref == "ngram":
        return NgramDrafter(), "ngram", None
    if ref in _EMBEDDED_DRAFT_ALIASES:
        from viasd_core.loading.draft_model import embedded_draft_dir, load_draft

        if target.model_id != EMBEDDED_TARGET:
            raise UsageError(f"the embedded draft was distilled for '{EMBEDDED_TARGET}', not '{target.model_id}': choose another --draft")
        draft_model = load_draft(embedded_draft_dir(), target.model, tokenizer=target.tokenizer)
        fast = FastModel(draft_model, max_len=target_fast.max_len, name="draft")
        return ModelDrafter(fast, vocab, vocab_map=draft_model.viasd_vocab_map), EMBEDDED_DRAFT, None
    head_folder = _feature_head_folder(ref, opts)
    if head_folder is not None:
        return feature_drafter(head_folder, target, target_fast), ref, None
    draft = load_model(ref, dtype=opts.dtype, device=opts.device, trust_remote_code=opts.trust_remote_code,
                       allow_pickle=opts.allow_pickle, quant=opts.draft_quant, progress=progress)
    check_same_vocab(target, draft)
    fast = FastModel(draft.model, max_len=target_fast.max_len, name="draft")
    # The target must never emit an id the draft cannot read, nor the draft propose one the target cannot.
    cap_vocab(target_fast, token_rows(draft.model))
    cap_vocab(fast, emittable(target_fast))
    return ModelDrafter(fast, vocab), draft.model_id, draft


def _feature_head_folder(ref: str, opts: ModelOptions):
    """The folder of an EAGLE-3 head named by `ref` (embedded, a local folder, or a cached hub repo), else None."""
    from viasd_core.loading import catalog
    from viasd_core.loading import hub
    from viasd_core.decoding.eagle import is_feature_head_folder

    if ref in _EMBEDDED_HEAD_ALIASES:
        return _embedded_head_dir()
    local = Path(ref).expanduser()
    if local.is_dir():
        return local if is_feature_head_folder(local) else None
    if hub.is_repo_id(ref) and (catalog.is_feature_head(ref) or (hub.is_cached(ref, opts.revision) and
                                                                  is_feature_head_folder(hub.resolve_local(ref)))):
        return hub.resolve_local(ref)
    return None


def feature_drafter(folder, target: Loaded, target_fast: FastModel) -> FeatureDrafter:
    """An EAGLE-3 head for the target (its embedding shared, its dtype and device) as a drafter."""
    from viasd_core.decoding.eagle import load_feature_head

    if target.model_id != EMBEDDED_TARGET and Path(folder) == _embedded_head_dir():
        raise UsageError(f"the embedded EAGLE-3 head was trained for '{EMBEDDED_TARGET}', not '{target.model_id}': "
                         "choose another --draft")
    head = load_feature_head(folder, target.model.config, embed=target_fast.embed, dtype=target_fast.dtype,
                             device=target_fast.device, max_len=target_fast.max_len + 1)
    return FeatureDrafter(head, target_fast, target_fast.shape.vocab_size)


def _embedded_head_dir() -> Path:
    from viasd_core.loading.draft_model import embedded_draft_dir

    return embedded_draft_dir("smollm2-135m-eagle3")


def build_session(opts: ModelOptions, mode: str = "sd", progress=None, need_profile: bool | None = None) -> Session:
    opts = dataclasses.replace(opts, quant=default_quant(opts.quant, opts.model, resolve_device(opts.device), opts.dtype))
    target = load_model(opts.model, dtype=opts.dtype, device=opts.device, revision=opts.revision,
                        trust_remote_code=opts.trust_remote_code, allow_pickle=opts.allow_pickle,
                        quant=opts.quant, progress=progress)
    max_context = context_size(target.model, opts.max_context, progress)
    target_fast = FastModel(target.model, max_len=max_context, name="target")
    cap_vocab(target_fast, token_rows(target.model))
    cap_vocab(target_fast, tokenizer_size(target.tokenizer))
    drafter, draft_id, draft = (None, "none", None)
    if mode != "ar" or opts.draft not in (None, "auto"):
        drafter, draft_id, draft = load_drafter(opts, target, target_fast, progress)
    profile = None
    slim = None
    if need_profile is None:
        need_profile = mode in ("exact", "viasd")
    if need_profile:
        profile = find_profile(target.model_id, draft_id, opts.quant, target_fast.device.type,
                               target_fast.shape.n_layers, explicit=opts.profile)
        slim = slim_verifier(target_fast, profile.view)
        if progress and profile.view.weights != TARGET_WEIGHTS:
            progress(f"slim view: {profile.view.describe(target_fast.shape.n_layers)} "
                     f"({twin_bytes(target.model, profile.view.weights) / 2**20:.0f} MiB beside the target's weights)")
    engine = Engine(target_fast, target.tokenizer, drafter=drafter, slim=slim, eos_token_ids=eos_ids(target),
                    context_len=max_context)
    session = Session(engine, target, draft_id, draft, profile, opts)
    if apply_compile(engine, opts.compile):
        if progress:
            progress("compiling the decoding graphs (torch.compile; cached for later runs)...")
        session.compile_seconds = engine.warm_up()
        if progress:
            progress(f"compiled the decoding graphs ({', '.join(engine.compiled_models)}) in {session.compile_seconds:.1f} s")
    return session


# ---------------------------------------------------------------------- context and compilation
def context_size(hf_model, requested: int | None, progress=None) -> int:
    """Positions every KV cache is allocated for: --max-context, or the model's own context capped
    at DEFAULT_CONTEXT_CAP and at what a quarter of free memory holds (target, slim and draft caches).
    A cap below the model's own context is said through `progress`, with how to raise it."""
    from viasd_core.decoding.model import model_shape

    shape = model_shape(hf_model)
    param = next(hf_model.parameters())
    elem = param.element_size() if param.dtype.is_floating_point else 4
    per_position = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * elem * 3  # target + slim + draft, at most
    free = free_memory_bytes(param.device)
    if requested is not None:
        if requested < 16:
            raise UsageError(f"--max-context must be at least 16, got {requested}")
        if requested > shape.max_positions:
            raise UsageError(f"--max-context {requested} exceeds the model's context ({shape.max_positions} positions)")
        if requested * per_position > 0.9 * free:
            raise ViasdError(
                f"KV caches for --max-context {requested} need {requested * per_position / 2**30:.1f} GiB but only "
                f"{free / 2**30:.1f} GiB is free on {param.device.type}: lower --max-context"
            )
        return int(requested)
    fits = int(0.25 * free // per_position)
    size = max(16, min(shape.max_positions, DEFAULT_CONTEXT_CAP, fits))
    if size < shape.max_positions and progress:
        amount = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.0f} MiB"
        cap = f"what a quarter of the {amount} free on {param.device.type} holds" if fits < DEFAULT_CONTEXT_CAP else "the default cap"
        progress(f"context: {size} positions ({cap}; the model's own is {shape.max_positions}): "
                 "raise it with --max-context")
    return size


def apply_compile(engine: Engine, choice: str) -> bool:
    """torch.compile the engine's models' passes (`auto`: on CUDA only). Returns whether any compiled."""
    if choice not in COMPILE_CHOICES:
        raise UsageError(f"unknown --compile '{choice}': use auto, on or off")
    if choice == "off" or (choice == "auto" and engine.device.type != "cuda"):
        return False
    # inductor's compiled kernels are cached on disk and re-used by later runs
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(paths.cache_dir() / "inductor"))
    return engine.compile()


# ---------------------------------------------------------------------- vocabulary rows
# Embedding row counts need not match the tokenizer: Qwen2.5-7B has 152064 rows, its 0.5B draft
# 151936, their tokenizer 151665 tokens. The rows past the tokenizer are padding; an id there is
# no token, and one past the draft's rows crashes the draft (IndexError; a device assert on CUDA).
# So every model of a session has its logits masked (FastModel.vocab_limit) below the smallest
# row count in play: it can then never emit such an id.
def token_rows(hf_model) -> int:
    """Token ids a model can both read and score: min(input embedding rows, lm_head rows)."""
    return min(hf_model.get_input_embeddings().num_embeddings, hf_model.get_output_embeddings().out_features)


def tokenizer_size(tokenizer) -> int | None:
    """One past the largest token id of the tokenizer (len() unless its ids have gaps); None without one."""
    if tokenizer is None:
        return None
    ids = tokenizer.get_vocab().values()
    return max(len(tokenizer), max(ids) + 1 if ids else 0)


def emittable(fast: FastModel) -> int:
    """The number of leading ids `fast` may emit (its logit width when unmasked)."""
    return fast.shape.vocab_size if fast.vocab_limit is None else fast.vocab_limit


def cap_vocab(fast: FastModel, limit: int | None) -> None:
    """Mask `fast`'s logits from id `limit` on, unless it is already masked as low or has no such id."""
    if limit is not None and limit < emittable(fast):
        fast.vocab_limit = int(limit)


def thresholds_of(profile: Profile | None) -> Thresholds | None:
    return Thresholds(profile.theta_accept, profile.theta_slim, profile.theta_confidence) if profile else None
