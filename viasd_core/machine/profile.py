"""The machine profile: every decision viasd makes about this machine, named in one table and
resolved in one order.

Each decision is a `Decision` (record.py) defined beside its measurement, one file per decision in
this folder: its name, the option it resolves, its version (bumped when what it measures changes:
that decision alone is measured again), its measurement and a line saying what it decides. The
stored ones keep their records in one folder keyed by the machine's identity (record.py).

A session resolves its decisions in ORDER, each resting on those before it:

    format -> threads -> short-rows -> compile -> tree -> first-block

- format (`--quant auto`): the weight format, timed when the target loads (formats are timed at
  torch's default thread count: nothing else is chosen yet);
- threads (`--threads auto`): timed on the loaded target every session, before anything later is
  timed or compiled (inductor's CPU kernels keep the count they were built with);
- short-rows: the float32 short passes' products, timed at the thread count just chosen;
- compile (`--compile auto`): a compiled pass's cost depends on all of the above;
- tree (`--tree auto`): the verify curve is timed on the passes as they run (format, threads,
  products, compiled or not);
- first-block: sd's first block without `-g`, derived from the tree's probe.

bf16-products and packed-way are machine-wide (MACHINE_WIDE): they depend on no model and no
setting, and are read once a process where first needed (bf16-products: an int format's CPU prefill,
training, doctor; packed-way: an int format loaded on a CPU, doctor).

`MachineProfile` holds what one session resolved, refuses a decision resolved after a later one,
and gives doctor and `--verbose` their picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from viasd_core.machine import bf16, first_block, packed_way, short_rows, threads, tree
from viasd_core.machine import compile as compiling
from viasd_core.machine import format as formats
from viasd_core.machine.record import Decision, machine_identity, machine_records

SHORT_ROWS = short_rows.DECISION

ORDER: tuple[Decision, ...] = (formats.DECISION, threads.DECISION, SHORT_ROWS, compiling.DECISION, tree.DECISION,
                               first_block.DECISION)
MACHINE_WIDE: tuple[Decision, ...] = (bf16.DECISION, packed_way.DECISION)
LABELS = {"format": "weights", "threads": "threads", "short-rows": "short passes", "compile": "compile",
          "tree": "tree", "first-block": "first block"}  # as --verbose and doctor name them


@dataclass
class Resolved:
    decision: Decision
    value: str  # what was chosen, in words
    reason: str  # why
    result: object  # the chooser's own answer (ThreadChoice, CompileChoice, TreeChoice, ...)


class MachineProfile:
    """One session's machine decisions on `device`, resolved in ORDER."""

    def __init__(self, device: torch.device):
        self.device = device
        self.resolved: dict[str, Resolved] = {}  # in the order resolved
        self.wide: dict[str, dict] = {}  # the machine-wide verdicts read so far (bf16_products, packed_way)

    def resolve(self, decision: Decision, choose: Callable[[], object], shown: Callable[[object], tuple[str, str]]):
        """`choose()`'s answer for `decision`, kept with `shown(answer)` = (value, reason). A decision
        comes after every one before it in ORDER: resolving it once a later one is resolved is a
        programming error (ValueError); resolving it again (doctor's refresh) replaces its answer."""
        names = [d.name for d in ORDER]
        if decision.name not in names:
            raise ValueError(f"'{decision.name}' is no session decision: the order is {' -> '.join(names)}")
        later = [n for n in self.resolved if names.index(n) > names.index(decision.name)]
        if later and decision.name not in self.resolved:
            raise ValueError(f"machine decision '{decision.name}' resolved after '{later[0]}': "
                             f"the order is {' -> '.join(names)}")
        result = choose()
        value, reason = shown(result)
        self.resolved[decision.name] = Resolved(decision, value, reason, result)
        return result

    def result(self, name: str):
        """The chooser's answer for decision `name`; None before it is resolved."""
        entry = self.resolved.get(name)
        return None if entry is None else entry.result

    def bf16_products(self, refresh: bool = False) -> dict:
        """The machine-wide bfloat16 verdict (machine/bf16.py: {"pays", ...}), read, or measured again
        (`refresh`), now; kept for the picture."""
        self.wide[bf16.DECISION.name] = bf16.verdict(self.device, refresh=refresh)
        return self.wide[bf16.DECISION.name]

    def packed_way(self, refresh: bool = False) -> dict:
        """The machine-wide choice of the packed products' way (machine/packed_way.py: {"portable",
        ...}), read, or measured again (`refresh`: for the picture; this process's products keep the
        way they were bound with), now; kept for the picture."""
        self.wide[packed_way.DECISION.name] = packed_way.verdict(self.device, refresh=refresh)
        return self.wide[packed_way.DECISION.name]

    def picture(self) -> dict:
        """What doctor shows of the profile, JSON-ready: the machine's identity, the records stored for
        it, and every decision (the machine-wide ones read, then the session's in ORDER): its name, option,
        version, what it chose and why (None where not resolved here) and what it decides."""
        decisions = []
        for decision in MACHINE_WIDE:
            if decision.name not in self.wide:
                continue
            verdict = self.wide[decision.name]
            if decision is packed_way.DECISION:
                decisions.append(_entry(decision, *packed_way.shown(verdict)))
                continue
            timed = (f"{verdict['bf16_ms']:g} ms bfloat16, {verdict['fp32_ms']:g} ms float32 a product"
                     if "bf16_ms" in verdict else "a GPU's support" if self.device.type == "cuda" else "not timed here")
            decisions.append(_entry(decision, "pay" if verdict["pays"] else "do not pay", timed))
        for decision in ORDER:
            entry = self.resolved.get(decision.name)
            decisions.append(_entry(decision, entry.value if entry else None, entry.reason if entry else None))
        return {"identity": machine_identity(self.device), "records": [p.name for p in machine_records(self.device)],
                "decisions": decisions}

    def choices(self) -> list[tuple[str, str, str]]:
        """(setting, value, reason) of each resolved decision, in ORDER (--verbose)."""
        return [(LABELS[d.name], self.resolved[d.name].value, self.resolved[d.name].reason)
                for d in ORDER if d.name in self.resolved]



def _entry(decision: Decision, value: str | None, reason: str | None) -> dict:
    return {"decision": decision.name, "setting": decision.setting, "version": decision.version, "value": value,
            "reason": reason, "explain": decision.explain}
