"""The slim view: the target seen through fewer layers, lower-precision weights, or both.

VIA-SD's middle tier is a cheaper view of the target that settles the tokens it is sure of. Two
axes make it cheaper: skipping layers (the layer mask `viasd calibrate` searches) and reading
fewer bytes per weight (an int8 / int4 weight-only twin of the target, weight_formats.py). A
view is a point on both: `SlimView(layer_ids, weights)`, where `weights` is TARGET_WEIGHTS (the
target's own modules, shared: the view costs only its KV cache) or a weight format (a packed copy
of the target made once per session and shared by every view at that format).

The full target always runs at the user's precision; the view only decides which tokens it needs
to see. Which view pays is measured, not assumed: calibration/candidates.py tries the candidates.
"""

from __future__ import annotations

import importlib.util
import weakref
from dataclasses import dataclass

import torch

from viasd_core.errors import ViasdError
from viasd_core.devices import free_memory_bytes
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.weight_format import NONE, PACKED, WeightFormat
from viasd_core.runtime.weight_formats import packed_bytes, packed_copy, weight_bytes

TARGET_WEIGHTS = "target"  # the view runs the target's own weights


@dataclass(frozen=True)
class SlimView:
    layer_ids: tuple[int, ...]  # the target's layers the view runs
    weights: str = TARGET_WEIGHTS  # TARGET_WEIGHTS or the name of a packed twin's format (weight_formats.FORMATS)

    def describe(self, n_layers: int) -> str:
        where = "the target's weights" if self.weights == TARGET_WEIGHTS else f"an {self.weights} copy"
        return f"{len(self.layer_ids)}/{n_layers} layers on {where}"


def lower_formats(target: WeightFormat = NONE, device: torch.device | None = None) -> tuple[str, ...]:
    """The weight formats (names) a slim view may use below the target's own precision: int8 and
    int4 under a floating-point target, int4 under int8; none under int4 (the lowest) or bitsandbytes
    (its weights are not re-packed), nor without torchao; on `device`, only those its kernels run
    (int4 needs a GPU of compute capability 8.0)."""
    if importlib.util.find_spec("torchao") is None or (target.quantized and not target.packed):
        return ()
    return tuple(f.name for f in PACKED
                 if (target.bits is None or f.bits < target.bits) and (device is None or f.runs_on(device)))


# A target's packed twins, one per format, alive as long as the target (a session's views share them).
_TWINS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]]" = weakref.WeakKeyDictionary()


def slim_weights(target_hf: torch.nn.Module, weights: str) -> torch.nn.Module:
    """The model whose modules a view at `weights` runs: the target itself, or its packed twin
    (made on first use after checking it fits in free memory)."""
    if weights == TARGET_WEIGHTS:
        return target_hf
    twins = _TWINS.setdefault(target_hf, {})
    if weights not in twins:
        check_twin_fits(target_hf, weights)
        twins[weights] = packed_copy(target_hf, WeightFormat.parse(weights))
    return twins[weights]


def twin_bytes(target_hf: torch.nn.Module, weights: str) -> int:
    """Bytes the view's weights add to the target's: its twin's (0 on the target's own weights)."""
    return 0 if weights == TARGET_WEIGHTS else weight_bytes(slim_weights(target_hf, weights))


def release_twins(target_hf: torch.nn.Module, keep=()) -> None:
    """Drop the target's packed twins except those of the formats in `keep` (calibration tries
    several and keeps one)."""
    twins = _TWINS.get(target_hf, {})
    for name in [n for n in twins if n not in keep]:
        del twins[name]


def check_twin_fits(target_hf: torch.nn.Module, weights: str) -> None:
    device = next(target_hf.parameters()).device
    need = packed_bytes(target_hf, WeightFormat.parse(weights))
    free = free_memory_bytes(device)
    if need > 0.9 * free:
        raise ViasdError(
            f"the slim view's {weights} copy of the target needs {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB "
            f"is free on {device.type}: calibrate with --slim-formats target (a layer mask on the target's own weights)"
        )


def slim_verifier(target_fast: FastModel, view: SlimView, max_len: int | None = None) -> FastModel:
    """The slim verifier for `view`, masked like the target (viasd emits its tokens too)."""
    model = slim_weights(target_fast.hf_model, view.weights)
    slim = FastModel(model, layer_ids=list(view.layer_ids), max_len=max_len or target_fast.max_len, name="slim")
    slim.vocab_limit = target_fast.vocab_limit
    # Nothing compares a slim pass with a pass of another width (the target verifies what must be
    # exact), so its short passes attend at once: int4 SmolLM2, 6 tokens: 34.0 ms vs 38.5 one by one.
    slim.row_attention = False
    return slim
