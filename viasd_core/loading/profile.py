"""Calibration profiles: the slim view (layer mask and weights) and the tier thresholds for one pair.

Keyed by target, draft, quantization and device type; stored as versioned JSON in the user
config directory, written atomically.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from viasd_core import paths
from viasd_core.errors import ViasdError
from viasd_core.runtime.slim_view import TARGET_WEIGHTS, SlimView
from viasd_core.runtime.weight_format import NONE
from viasd_core.runtime.weight_formats import FORMATS

PROFILE_VERSION = 2  # 2 added the slim view's weights and the candidates calibration compared
READABLE_VERSIONS = (1, 2)  # a version-1 profile's slim view runs the target's own weights


@dataclass
class Profile:
    target_id: str
    draft_id: str
    quant: str
    device: str  # device type: cpu / cuda
    dtype: str
    layer_ids: list[int]  # layers the slim verifier runs
    n_layers: int
    theta_accept: float
    theta_slim: float
    budget: float  # largest fidelity loss allowed
    heldout_fidelity: float | None  # measured on held-out prompts; None (JSON null): not measured
    fit_fidelity: float | None = None  # replayed on the fit prompts; None: not measured
    target_revision: str | None = None
    draft_revision: str | None = None
    slim_agreement: float = 0.0  # top-1 agreement slim vs target on calibration text
    costs: dict = field(default_factory=dict)  # measured per-pass costs (seconds)
    modeled_tokens_per_s: float = 0.0
    measured: dict = field(default_factory=dict)  # held-out run statistics
    created: str = ""
    version: int = PROFILE_VERSION
    theta_confidence: float = 0.0  # positions where the slim's top-1 probability is below it go to the target
    slim_weights: str = TARGET_WEIGHTS  # or the weight format of the target's packed twin
    candidates: list = field(default_factory=list)  # every slim view calibration measured, with its figures

    @property
    def view(self) -> SlimView:
        return SlimView(tuple(int(i) for i in self.layer_ids), self.slim_weights)

    @property
    def skip_ratio(self) -> float:
        return 1 - len(self.layer_ids) / self.n_layers

    def to_json(self) -> dict:
        return asdict(self)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def profile_path(target_id: str, draft_id: str, quant: str, device: str) -> Path:
    name = f"{_slug(target_id)}__{_slug(draft_id)}__{quant}__{device}.json"
    return paths.config_dir() / "profiles" / name


def save_profile(profile: Profile, path: Path | None = None) -> Path:
    path = path or profile_path(profile.target_id, profile.draft_id, profile.quant, profile.device)
    paths.atomic_write_json(path, profile.to_json())
    return path


def read_profile(path: Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ViasdError(f"profile '{path}' not found")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ViasdError(f"profile '{path}' is corrupt (not JSON): delete it and run `viasd calibrate` again")
    if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
        raise ViasdError(f"profile '{path}' has an unknown version: run `viasd calibrate` again")
    try:
        profile = Profile(**data)
        layer_ids = [int(i) for i in profile.layer_ids]
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= profile.n_layers:
            raise ValueError("layer ids")
        float(profile.theta_accept), float(profile.theta_slim), float(profile.theta_confidence)
        if profile.slim_weights not in (TARGET_WEIGHTS, *FORMATS):
            raise ValueError("slim weights")
    except (TypeError, ValueError):
        raise ViasdError(f"profile '{path}' is corrupt (missing or invalid fields): delete it and run `viasd calibrate` again")
    return profile


def check_profile(profile: Profile, target_id: str, draft_id: str, quant: str, device: str, n_layers: int, path=None) -> None:
    """Refuse a profile made for another pair, quantization, device or model shape."""
    where = f"profile '{path}'" if path else "the profile"
    if (profile.target_id, profile.draft_id) != (target_id, draft_id):
        raise ViasdError(
            f"{where} was made for target '{profile.target_id}' with draft '{profile.draft_id}', not '{target_id}' with "
            f"'{draft_id}': run `viasd calibrate --model {target_id} --draft {draft_id}`"
        )
    if profile.quant != quant:
        raise ViasdError(f"{where} was made for quantization '{profile.quant}', not '{quant}': run `viasd calibrate --quant {quant}`")
    if profile.device != device:
        raise ViasdError(f"{where} was made on {profile.device}, not {device}: run `viasd calibrate` on this device")
    if profile.n_layers != n_layers:
        raise ViasdError(f"{where} is for a model with {profile.n_layers} layers, this one has {n_layers}: run `viasd calibrate` again")


def find_profile(target_id: str, draft_id: str, quant: str, device: str, n_layers: int, explicit: str | None = None) -> Profile:
    path = Path(explicit) if explicit else profile_path(target_id, draft_id, quant, device)
    if not path.exists():
        if explicit:
            raise ViasdError(f"profile '{explicit}' not found")
        quant_opt = f" --quant {quant}" if quant != NONE.name else ""
        raise ViasdError(
            f"no calibration profile for target '{target_id}' with draft '{draft_id}' ({quant}, {device}): "
            f"run `viasd calibrate --model {target_id} --draft {draft_id}{quant_opt}`"
        )
    profile = read_profile(path)
    check_profile(profile, target_id, draft_id, quant, device, n_layers, path)
    return profile


def list_profiles() -> list[Path]:
    folder = paths.config_dir() / "profiles"
    return sorted(folder.glob("*.json")) if folder.exists() else []
