"""sd's first block where the user gives no `-g`: derived from `--tree auto`'s probe, not measured
on its own (so never stored: it follows the tree decision's record).

The fastest chain of the probe on this machine (machine/tree.py: TreeChoice.best_chain), raised to
draft_policy.FLOOR and held to the block's cap; draft_policy.UNMEASURED_START where nothing was
measured (`--tree off` or N, other modes). draft_policy says why a measured first block is also
the block's floor, and what it gained.
"""

from __future__ import annotations

from viasd_core.speculation.draft_policy import FLOOR, UNMEASURED_START
from viasd_core.machine.record import Decision


def first_block(best_chain: int | None, gamma_max: int) -> tuple[int, str]:
    """The first block (every block with --fixed) when the user gave none: `best_chain`, the
    probe's fastest chain length on this machine, raised to FLOOR and held to gamma_max; or
    UNMEASURED_START when nothing was measured (None). Returns (drafts, why)."""
    if best_chain is None:
        return min(UNMEASURED_START, gamma_max), "not measured here (--tree auto's probe did not run)"
    start = max(FLOOR, min(best_chain, gamma_max))
    why = f"the probe's fastest chain on this machine is {best_chain} draft{'s' if best_chain != 1 else ''}"
    if start != best_chain:
        why += f"; raised to the floor of {FLOOR}" if start > best_chain else f"; held to {gamma_max}"
    return start, why


DECISION = Decision("first-block", "sd without -g", None, first_block,  # not stored: derived from the tree's record
                    "sd's first block (and floor): the fastest chain of --tree auto's probe, raised to the floor and "
                    "held to the cap")
