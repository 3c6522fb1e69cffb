"""Builds the drafter a session asks for (`load_drafter`): prompt lookup (`ngram`), the suffix index
that remembers earlier requests (`suffix`), a draft model, an EAGLE-3 head, or a model with a lookup
beside it (REF+ngram, REF+suffix), each behind decoding.drafters.Drafter.
`--draft auto` picks the best draft here for the target (draft_choice.py)."""

from __future__ import annotations

from pathlib import Path

from viasd_core.speculation.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from viasd_core.speculation.hybrid_drafter import HybridDrafter
from viasd_core.speculation.suffix_drafter import SuffixDrafter
from viasd_core.speculation.feature_drafter import FeatureDrafter
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.model import FastModel
from viasd_core.errors import UsageError
from viasd_core.loading.draft_choice import EMBEDDED_DRAFT, EMBEDDED_HEAD, DraftChoice, choose_draft
from viasd_core.loading.models import EMBEDDED_TARGET, Loaded, check_same_vocab, load_model
from viasd_core.loading.options import ModelOptions
from viasd_core.loading.vocab_rows import cap_vocab, emittable, token_rows
from viasd_core.runtime.weight_formats import BF16_PAYS, bf16_pays_of

# Where the target runs int8/int4 on a CPU, the head's products run int8 too: the embedded head's
# products took 0.164 against 0.474 ms a pass (bfloat16), and fixed-block `sd` over the 26 held-out
# prompts made 1,827 target passes against 1,824 for the same 3,125 tokens (docs/experiments/pass-python-int4-prefill-widening.md)
HEAD_FORMAT = WeightFormat.parse("int8")
# The model-free drafts, by --draft name, and REF+NAME: that lookup beside the model draft REF
LOOKUPS = {"ngram": NgramDrafter, "suffix": SuffixDrafter}
_EMBEDDED_DRAFT_ALIASES = {EMBEDDED_DRAFT, "smollm2-135m-draft"}
_EMBEDDED_HEAD_ALIASES = {EMBEDDED_HEAD, "smollm2-135m-eagle3"}


def draft_ref(opts: ModelOptions, target: Loaded) -> str:
    """The draft reference to load: --draft as given, or `auto`'s choice (draft_choice.py)."""
    return draft_choice(opts, target).ref


def draft_choice(opts: ModelOptions, target: Loaded) -> DraftChoice:
    """--draft as given (and that it was asked for), or `auto`'s best draft here and why."""
    ref = (opts.draft or "auto").strip()
    if ref != "auto":
        return DraftChoice(ref, "asked for (--draft)")
    return choose_draft(target)


def load_drafter(opts: ModelOptions, target: Loaded, target_fast: FastModel, progress=None):
    """The drafter for the options: (drafter or None, draft id, Loaded or None)."""
    ref = draft_ref(opts, target)
    base, plus, lookup = ref.rpartition("+")
    if plus and base and lookup in LOOKUPS:
        drafter, draft_id, draft = load_drafter(ModelOptions(**{**opts.__dict__, "draft": base}), target, target_fast,
                                                progress)
        if not isinstance(drafter, ChainDrafter):
            raise UsageError(f"'{ref}': the +{lookup} suffix goes after a draft model")
        return HybridDrafter(drafter, LOOKUPS[lookup]()), f"{draft_id}+{lookup}", draft
    vocab = target_fast.shape.vocab_size
    if ref == "none":
        return None, "none", None
    if ref in LOOKUPS:
        return LOOKUPS[ref](), ref, None
    if ref in _EMBEDDED_DRAFT_ALIASES:
        from viasd_core.loading.draft_model import embedded_draft_dir, load_draft

        if target.model_id != EMBEDDED_TARGET:
            raise UsageError(f"the embedded draft was distilled for '{EMBEDDED_TARGET}', not '{target.model_id}': choose another --draft")
        draft_model = load_draft(embedded_draft_dir(), target.model, tokenizer=target.tokenizer)
        fast = FastModel(draft_model, max_len=target_fast.max_len, name="draft")
        return ModelDrafter(fast, vocab, vocab_map=draft_model.viasd_vocab_map), EMBEDDED_DRAFT, None
    head_folder = _feature_head_folder(ref, progress)
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


def _feature_head_folder(ref: str, progress=None):
    """The folder of an EAGLE-3 head named by `ref` (embedded, a local folder, or a hub repo: the cached
    snapshot at main, the head's own revision, not the target's --revision; downloaded on first use,
    as `viasd pull` does), else None."""
    from viasd_core.loading import catalog
    from viasd_core.loading import hub
    from viasd_core.loading.hub_pull import fetch
    from viasd_core.loading.progress import shows_progress
    from viasd_core.speculation.eagle_files import is_feature_head_folder

    if ref in _EMBEDDED_HEAD_ALIASES:
        return _embedded_head_dir()
    local = Path(ref).expanduser()
    if local.is_dir():
        return local if is_feature_head_folder(local) else None
    if hub.is_repo_id(ref):
        folder = fetch(ref, progress=shows_progress(progress), head=catalog.is_feature_head(ref))
        return folder if is_feature_head_folder(folder) else None
    return None


def feature_drafter(folder, target: Loaded, target_fast: FastModel) -> FeatureDrafter:
    """An EAGLE-3 head for the target (its embedding shared, its dtype and device) as a drafter."""
    from viasd_core.speculation.eagle_files import load_feature_head

    if target.model_id != EMBEDDED_TARGET and Path(folder) == _embedded_head_dir():
        raise UsageError(f"the embedded EAGLE-3 head was trained for '{EMBEDDED_TARGET}', not '{target.model_id}': "
                         "choose another --draft")
    head = load_feature_head(folder, target.model.config, embed=target_fast.embed, dtype=target_fast.dtype,
                             device=target_fast.device, max_len=target_fast.max_len + 1)
    if target_fast.weight_format and target_fast.device.type == "cpu":
        setattr(head, BF16_PAYS, bf16_pays_of(target.model))  # the machine's verdict, as the target's loader recorded it
        head.pack_products(HEAD_FORMAT)
    return FeatureDrafter(head, target_fast, target_fast.shape.vocab_size)


def _embedded_head_dir() -> Path:
    from viasd_core.loading.draft_model import embedded_draft_dir

    return embedded_draft_dir("smollm2-135m-eagle3")
