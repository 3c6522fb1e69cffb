"""Pass costs, measured on this machine, and the throughput they model for a replayed run.

The threshold fit compares threshold sets by modeled tokens/s: the draft's, the target's and the
slim verifier's passes, each priced by `pass_costs` (the median of timed passes over 1 token and
over a block after a cached context). docs/algorithm.md section 5.
"""

from __future__ import annotations

from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_timing import time_passes
from viasd_core.speculation.router import OFF, BlockRecord, ReplayOutcome, Thresholds, replay


def pass_costs(model: FastModel, name: str, block: int, context: int = 256, repeats: int = 7) -> dict:
    """Median seconds of `model`'s pass over `block` tokens and over 1 token after `context`
    cached positions (runtime/pass_timing.py): {name: block pass, name_1: 1-token pass}."""
    seconds = time_passes(model, sorted({1, block}), context, repeats)
    return {name: seconds[block], f"{name}_1": seconds[1]}


def measure_costs(target: FastModel, draft: FastModel | None, context: int = 256, block: int = 6, repeats: int = 7) -> dict:
    """Seconds of one pass, measured here: the target over `block` tokens and over 1 token
    (`target_1`), one draft token; `block` records the width. A slim view's come from pass_costs."""
    costs = {"block": block, **pass_costs(target, "target", block, context, repeats)}
    costs["draft"] = pass_costs(draft, "draft", 1, context, repeats)["draft"] if draft is not None else 0.0
    return costs


def pass_seconds(costs: dict, name: str, passes: int, positions: int) -> float:
    """Seconds of `passes` passes of model `name` over `positions` positions in all: linear in a
    pass's width between the measured 1-token and block passes (on a CPU a wider pass costs more;
    a target skipped for a few steps runs their tokens in its next pass). Flat per pass where
    only the block pass was measured."""
    block, one, width = costs[name], costs.get(f"{name}_1"), costs.get("block", 0)
    if one is None or width < 2:
        return passes * block
    per_position = max(0.0, (block - one) / (width - 1))
    return passes * one + per_position * max(0, positions - passes)


def modeled_tokens_per_s(outcome: ReplayOutcome, costs: dict) -> float:
    seconds = (outcome.drafted * costs["draft"] + pass_seconds(costs, "target", outcome.target_passes, outcome.target_positions))
    if outcome.slim_passes:
        seconds += pass_seconds(costs, "slim", outcome.slim_passes, outcome.slim_positions)
    return outcome.tokens / seconds if seconds > 0 else 0.0


def sd_outcome(blocks: list[BlockRecord]) -> ReplayOutcome:
    """What plain sd does on the same blocks: viasd with both tiers off (one target pass per
    block, no slim pass; the target's tokens up to its first disagreement, then its own)."""
    return replay(blocks, Thresholds(OFF, OFF))


