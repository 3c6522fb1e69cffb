"""The short-rows decision: which products a model's short float32 passes take on this machine
(blocked, packed through oneDNN, or PyTorch's plain F.linear) and whether a prefill chunk takes the
packed product, timed once per machine, thread count and session key (runtime/short_products.py
holds the products themselves and `pick_rows`, the rule that reads the timings)."""

from __future__ import annotations

from viasd_core import devices
from viasd_core.runtime import pass_timing
from viasd_core.runtime.model_pass import PREFILL_CHUNK
from viasd_core.runtime.short_products import (FREE_SHARE, PLAIN, SHORT_ROWS, TIMED, WAYS, _VALID, ShortRows, applies,
                                                packed_bytes, packs, pick_rows)
from viasd_core.machine.record import Decision

VERSION = 2  # bumped when what choose_rows measures or stores changes


def choose_rows(engine, key: dict | None = None, refresh: bool = False, repeats: int = 3) -> tuple[ShortRows, str]:
    """Time a 1-, a MID- and a WIDE-token pass (and a prefill chunk, packed and plain) of the first
    of the engine's models (target, slim, draft) whose output head `applies`, each way (blocked;
    packed where the build has oneDNN and its copies fit in FREE_SHARE of the free memory;
    F.linear), and give every model and the drafter what `pick_rows` makes of them
    (Engine.set_short_rows): (rows, reason). Without such a model (a GPU, low-bit or bfloat16
    weights) rows is PLAIN.

    With `key` (what the session runs: models, format, dtype) the choice is cached per machine and
    thread count (DECISION's record; `refresh` measures again): the timing costs a few seconds."""
    timed = next((m for m in engine.all_models() if applies(m.lm_head)), None)
    record = DECISION.record(engine.device, key) if key is not None else None
    cached = _cached(record.load()) if timed is not None and record is not None and not refresh else None
    need, free = (packed_bytes(engine.all_models()), devices.free_memory_bytes(engine.device)) if timed is not None else (0, 0)
    fits = need <= FREE_SHARE * free
    crowded = f"; packed not taken: its copies ({need / 2**30:.2f} GiB) would fill over half the free memory ({free / 2**30:.2f} GiB)"
    if timed is None:
        rows, reason = PLAIN, "no float32 layers on a CPU"
    elif cached is not None:
        rows, reason = cached
        if (rows.packed or rows.prefill) and not fits:  # memory is not what it was when measured
            rows, reason = rows._replace(packed=0, prefill=False), reason + crowded
    else:
        ways = {w: r for w, r in WAYS.items() if w != "packed" or (packs(timed.lm_head) and fits)}
        # a prefill chunk, packed and plain (one pass each a round: about 0.3 s for SmolLM2 in float32)
        long = min(PREFILL_CHUNK, timed.max_len - 2) if "packed" in ways else 0
        seconds = {}
        for _ in range(2):  # interleaved rounds, each way's best kept
            for way, rows in ways.items():
                timed.short_rows = rows
                timings = pass_timing.time_passes(timed, TIMED, context=64, repeats=repeats)
                if long > SHORT_ROWS and way != "blocked":
                    timings[long] = pass_timing.time_passes(timed, (long,), context=1, repeats=1)[long]
                for w, s in timings.items():
                    seconds[(way, w)] = min(s, seconds.get((way, w), float("inf")))
        rows, reason = pick_rows(seconds)
        if record is not None:
            record.store({"blocked": rows.blocked, "packed": rows.packed, "prefill": rows.prefill, "reason": reason})
        if packs(timed.lm_head) and not fits:
            reason += crowded
    engine.set_short_rows(rows)
    return rows, reason


def _cached(data: dict | None) -> tuple[ShortRows, str] | None:
    """(rows, reason) of a stored choice; None when there is none or its fields do not fit (measured again)."""
    try:
        rows = ShortRows(int(data["blocked"]), int(data["packed"]), data["prefill"])
        if tuple(rows) not in _VALID or not isinstance(rows.prefill, bool):
            return None
        return rows, str(data["reason"]) + " (cached)"
    except (ValueError, KeyError, TypeError):
        return None


DECISION = Decision("short-rows", "", VERSION, choose_rows,
                    "which products short float32 passes take (blocked, packed, plain), timed here at the chosen "
                    "thread count")
