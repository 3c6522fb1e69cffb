"""`--draft auto`: the best draft for the target that is here now, and why.

Ranking (the first that is available wins):
  1. the embedded target: its EAGLE-3 head trained by viasd, else its distilled draft model, each with
     prompt lookup beside it (the best measured: docs/performance.md);
  2. a published EAGLE-3 head the catalog lists for the target, in the HF cache;
  3. any other EAGLE-3 head in the HF cache whose shapes fit the target (hidden size, vocabulary,
     feature layers: eagle_files.check_head_config); not vouched for by the catalog, so below it;
  4. a draft model the catalog lists for the target, in the HF cache;
  5. prompt lookup (`ngram`), which needs nothing.
A head drafts from the target's own features, so it is ranked above a separate small model.
Every lookup reads the cache at each draft's own revision (main), never the target's --revision,
and nothing is downloaded: `auto` only picks among what is here (`viasd pull NAME` fetches a pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from viasd_core.errors import ViasdError

NGRAM = "ngram"
EMBEDDED_DRAFT = "embedded:smollm2-135m-draft"  # the distilled 2-layer draft model
EMBEDDED_HEAD = "embedded:smollm2-135m-eagle3"  # the EAGLE-3 head trained by viasd (the default)
HYBRID_SUFFIX = "+ngram"  # REF+ngram: prompt lookup where the context repeats, the model draft elsewhere


@dataclass(frozen=True)
class DraftChoice:
    ref: str  # what --draft would have said: a reference load_drafter takes
    reason: str  # why, in words (--verbose)


def choose_draft(target) -> DraftChoice:
    """The best draft here for `target` (a loading.models.Loaded): see the module's ranking."""
    from viasd_core.loading.models import EMBEDDED_TARGET

    if target.model_id == EMBEDDED_TARGET:
        return _embedded_choice()
    from viasd_core.loading import catalog, hub

    pairs = [p for p in catalog.PAIRS if not p.embedded and p.target.lower() == target.model_id.lower()]
    heads = [p for p in pairs if p.draft_kind == "feature"]
    models = [p for p in pairs if p.draft_kind != "feature"]
    missing = []
    for pair in heads:
        if hub.is_cached(pair.draft):
            return DraftChoice(pair.draft, f"the published EAGLE-3 head of catalog pair {pair.name}, in the cache "
                                           "(a head drafts from the target's own features: ranked above draft models)")
        missing.append(pair.name)
    catalogued = {p.draft.lower() for p in pairs}
    for repo_id in cached_heads():
        if repo_id.lower() not in catalogued and _head_fits(repo_id, target):
            return DraftChoice(repo_id, "an EAGLE-3 head in the cache whose shapes fit the target (not in the "
                                        "catalog for it: ranked below catalog heads, above draft models)")
    for pair in models:
        if hub.is_cached(pair.draft):
            skipped = f"; not cached: {', '.join(missing)}" if missing else ""
            return DraftChoice(pair.draft, f"the draft model of catalog pair {pair.name}, in the cache{skipped}")
        missing.append(pair.name)
    if missing:
        return DraftChoice(NGRAM, f"prompt lookup: no draft for the target in the cache (catalog pairs not "
                                  f"pulled: {', '.join(missing)}; `viasd pull NAME` fetches one)")
    return DraftChoice(NGRAM, "prompt lookup: no draft for the target in the cache and none in the catalog")


def _embedded_choice() -> DraftChoice:
    from viasd_core.loading.draft_model import embedded_draft_dir

    found = [(EMBEDDED_HEAD, "smollm2-135m-eagle3", "the embedded EAGLE-3 head trained by viasd"),
             (EMBEDDED_DRAFT, "smollm2-135m", "the embedded distilled draft model (the head is not installed)")]
    for ref, name, what in found:
        if (embedded_draft_dir(name) / "model.safetensors").exists():
            return DraftChoice(ref + HYBRID_SUFFIX, f"{what}, prompt lookup beside it: the best measured for the "
                                                    "embedded target (docs/performance.md)")
    return DraftChoice(NGRAM, "prompt lookup: the package's embedded drafts are missing")


def cached_heads() -> list[str]:
    """Hub ids of the EAGLE-3 heads complete in the HF cache at main, sorted."""
    from viasd_core.speculation.eagle_files import is_feature_head_folder
    from viasd_core.loading import hub

    found = []
    root = hub.hf_cache_dir()
    for folder in sorted(root.glob("models--*--*")) if root.is_dir() else ():
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        if not hub.is_repo_id(repo_id):
            continue
        try:
            snapshot = hub.resolve_local(repo_id)
        except ViasdError:
            continue
        if is_feature_head_folder(snapshot):
            found.append(repo_id)
    return found


def _head_fits(repo_id: str, target) -> bool:
    from viasd_core.speculation.eagle_files import check_head_config, read_head_config
    from viasd_core.loading import hub

    try:
        check_head_config(read_head_config(Path(hub.resolve_local(repo_id))), target.model.config, repo_id)
    except ViasdError:
        return False
    return True
