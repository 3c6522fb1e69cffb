"""Calibration's view of the engine: an observer that turns every speculative step into a BlockRecord.

A BlockRecord (router.py) holds, for one drafted block, the slim verifier's gate, choice and
confidence at every position and the target's greedy choice there: everything `router.replay`
needs to replay the tiers under any thresholds. The engine's steps know nothing of this; the
recorder sees each committed `StepResult` from outside (`Engine.observers`) and runs whatever pass
the step did not run itself over the block as the draft proposed it:

- the slim verifier, in an `sd` step (a `viasd` step already ran it: `StepResult.route`);
- the target, in a `viasd` step whose walk never reached a 'full' position.

Those passes read a private copy of the token buffer with the drafted block in place (the engine's
buffer holds the emitted tokens by now), and afterwards each model keeps only what the emitted
tokens confirm, exactly as if the step had run the pass itself. Nothing the recorder reads is an
output of an earlier compiled call: the step hands over host lists and tensors it owns, and the
recorder's own passes are read before the next one runs (CUDA graphs may overwrite a compiled
call's outputs at the next call).
"""

from __future__ import annotations

import torch
from viasd_kernels import route_block

from viasd_core.speculation.engine import Engine
from viasd_core.speculation.router import OFF, BlockRecord, slim_confidence
from viasd_core.speculation.steps import StepResult, common_prefix


class BlockRecorder:
    """Install with `engine.observers.append(recorder)`; greedy speculative steps only."""

    def __init__(self):
        self.blocks: list[BlockRecord] = []

    def __call__(self, engine: Engine, step: StepResult) -> None:
        if not step.drafted or engine.slim is None:
            return  # a plain step: nothing was drafted
        n, g = step.position, step.drafted  # the proposals (a draft may have drafted more: Proposal.limit)
        draft_tokens = step.draft_tokens[:g]
        drafted = draft_tokens.tolist()
        valid = common_prefix(step.tokens, drafted)  # drafted positions the emitted tokens confirm
        ids = None
        route = step.route
        if route is None:  # the slim did not run in this step: run it over the drafted block
            ids = self._with_block(engine, n, draft_tokens)
            if engine.slim.seen < n - 1:  # the slim's prefill, as a mode that runs it would have done
                engine.slim.extend(ids, n - 1, 1)
            slim_logits = engine.slim.extend(ids, n + g, g + 1)  # [g + 1, V]
            route = route_block(slim_logits, ids[n : n + g], 0.0, OFF, OFF)  # the gate only
            engine.slim.rollback(n + valid)
        target_argmax = step.target_argmax[: g + 1] if step.target_argmax is not None else None
        if target_argmax is None:  # the walk never needed the target: its choices are the labels
            ids = ids if ids is not None else self._with_block(engine, n, draft_tokens)
            target_argmax = engine.target.extend(ids, n + g, g + 1).argmax(-1).tolist()  # [g + 1]
            engine.target.rollback(n + valid)
        self.blocks.append(BlockRecord.from_choices(route.gate.tolist(), drafted, route.argmax.tolist(), target_argmax,
                                                    slim_confidence(route, g).tolist()))

    @staticmethod
    def _with_block(engine: Engine, n: int, draft_tokens: torch.Tensor) -> torch.Tensor:
        """A copy of the engine's token buffer with the drafted block at [n, n + g)."""
        ids = engine.ids.clone()
        ids[n : n + draft_tokens.shape[0]] = draft_tokens
        return ids
