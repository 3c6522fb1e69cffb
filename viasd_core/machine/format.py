"""`--quant auto` on a CPU: the weight format a model runs, chosen by timing it on this machine.

Which formats may be chosen is a question of quality, answered once per model by measuring it
(`QUALITY_MEASURED`): for the embedded target, fp32 and the int8 and int4 copies agree with fp32's
greedy token at 0.971 (int8) and 0.978 (int4) teacher-forced, over the 0.97 bar (docs/experiments/int8-int4-weight-only.md). Which of those is fastest is a question of the machine: on a CPU whose int4 kernel is
slow (no AVX-512, an older PyTorch) int8 or fp32 can win. So each candidate is loaded and timed once,
a 1-token pass (plain decoding) and a 4-token pass (a verify pass) after 64 cached positions
(runtime/pass_timing.py; the best of three interleaved rounds; float32 with each of its short
products and without, runtime/short_products.py), and the smallest sum wins; a more precise format within TIE of it wins
instead. Prefill is not in the sum.

The choice is cached under the user's cache folder per model and machine (machine/record.py: the
machine's identity and the thread count it was timed at); `viasd doctor` measures again (`forget`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

import torch

from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_timing import time_passes
from viasd_core.runtime.short_products import BLOCKED, PACKED, PLAIN, applies, packs
from viasd_core.runtime.weight_format import INT4, INT8, NONE, WeightFormat
from viasd_core.machine.record import Decision, MachineRecord

# Formats whose quality was measured on the model (greedy agreement with fp32 >= 0.97), most
# precise first; models missing here get none from auto.
QUALITY_MEASURED = {"smollm2-135m": (NONE, INT8, INT4)}
TIE = 0.05  # a more precise format within 5% of the fastest is chosen instead
WIDTHS = (1, 4)
CONTEXT = 64
REPEATS = 5
ROUNDS = 3


@dataclass
class FormatChoice:
    format: WeightFormat
    reason: str
    seconds: dict[str, float]  # format name -> seconds of a 1-token and a 4-token pass, summed


def pick(seconds: dict[WeightFormat, float]) -> tuple[WeightFormat, str]:
    """The format to run from each candidate's measured seconds (in preference order, most
    precise first): the fastest, or a more precise one within TIE of it."""
    fastest = min(seconds.values())
    best = next(fmt for fmt, s in seconds.items() if s <= fastest * (1 + TIE))
    shown = ", ".join(f"{fmt} {s * 1e3:.1f} ms" for fmt, s in seconds.items())
    ground = "the fastest" if seconds[best] == fastest else f"within {TIE:.0%} of the fastest and more precise"
    return best, f"{best}: {ground} here ({shown} for a 1-token plus a 4-token pass)"


def measure(load: Callable[[WeightFormat], torch.nn.Module], candidates: tuple[WeightFormat, ...],
            device: torch.device) -> dict[WeightFormat, float]:
    """Seconds of a 1-token plus a 4-token pass of the model `load(fmt)` gives at each format on
    `device`. All are loaded, then timed in turn for ROUNDS rounds, and each keeps its best round: a
    neighbour's burst of load on a shared machine then slows one round, not one format."""
    curves = time_formats(load, candidates, device, WIDTHS, CONTEXT, REPEATS, ROUNDS)
    return {fmt: sum(curve.values()) for fmt, curve in curves.items()}


def time_formats(load: Callable[[WeightFormat], torch.nn.Module], candidates: tuple[WeightFormat, ...],
                 device: torch.device, widths: tuple[int, ...], context: int, repeats: int,
                 rounds: int) -> dict[WeightFormat, dict[int, float]]:
    """Median seconds of a pass over each of `widths` tokens after `context` cached positions, for
    the model `load(fmt)` gives at each format (loading/models.format_loader: the loading wing loads,
    this one times) (runtime/pass_timing.py): the round, and for float32 the short product, of the
    least total (a session picks its short product: runtime/short_products.py)."""
    models = {fmt: FastModel(load(fmt), max_len=context + max(widths) + 1) for fmt in candidates}
    for model in models.values():
        time_passes(model, widths, context, repeats=1)  # warm-up: first-call allocations and probes
    best: dict[WeightFormat, dict[int, float]] = {}
    for _ in range(rounds):
        for fmt, model in models.items():
            # float32 at its best: with each short product and without (a session picks)
            ways = (BLOCKED, PLAIN) + ((PACKED,) if packs(model.lm_head) else ()) if applies(model.lm_head) else ()
            for rows in ways or (model.short_rows,):
                model.short_rows = rows
                curve = time_passes(model, widths, context, repeats)
                if fmt not in best or sum(curve.values()) < sum(best[fmt].values()):
                    best[fmt] = curve
    del models
    gc.collect()
    return best


# versions: 2: float32 timed with its blocked short products too; 3: int8/int4 products fused; 4: float32
# packed products; 5: int8/int4 rows attend through the row kernel; 6: int8/int4 short passes through
# cpu_packed_mm; 7: its scales read block by block (int4 1-token passes ~20% faster); 8: int4 layers' calls
# up to the MLP in one C call (~21% faster again)
DECISION = Decision("format", "--quant auto", 8, measure,
                    "the fastest weight format of measured quality for the model here (a 1- plus a 4-token pass each)")


def cache_record(ref: str, device: torch.device) -> MachineRecord:
    return DECISION.record(device, {"model": ref.lower()})


def choose_format(ref: str, device: torch.device, candidates: tuple[WeightFormat, ...], progress=None,
                  timer: Callable[..., dict[WeightFormat, float]] | None = None,
                  load: Callable[[WeightFormat], torch.nn.Module] | None = None) -> FormatChoice:
    """The fastest of `candidates` for model `ref` on this machine: cached, else timed (`timer(ref,
    candidates, device)`; by default `measure` over the models `load(fmt)` gives)."""
    record = cache_record(ref, device)
    names = [fmt.name for fmt in candidates]
    cached = record.read(lambda data: _from_json(data, candidates))
    if cached is not None:
        return cached
    if progress:
        progress(f"timing {', '.join(names)} passes on this machine for --quant auto (once; cached)...")
    if timer is None and load is None:
        raise ValueError("choose_format needs a timer or a loader")
    seconds = timer(ref, candidates, device) if timer is not None else measure(load, candidates, device)
    chosen, reason = pick(seconds)
    named = {fmt.name: s for fmt, s in seconds.items()}
    record.store({"model": ref, "format": chosen.name, "reason": reason, "seconds": named})
    return FormatChoice(chosen, reason, named)


def _from_json(data: dict, candidates: tuple[WeightFormat, ...]) -> FormatChoice | None:
    """The stored choice; None where it was made between other candidates (measured again)."""
    if sorted(data["seconds"]) != sorted(fmt.name for fmt in candidates):
        return None
    chosen = next(fmt for fmt in candidates if fmt.name == data["format"])
    return FormatChoice(chosen, data["reason"] + " (cached)", data["seconds"])


def forget(ref: str, device: torch.device) -> None:
    """Drop the cached choice for model `ref` on this machine: the next `auto` measures again."""
    cache_record(ref, device).forget()
