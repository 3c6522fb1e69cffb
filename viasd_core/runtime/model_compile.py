"""Compiling a FastModel's pass: `compile()` wraps the one pass function in
`torch.compile(fullgraph=True)` (CUDA graphs on CUDA); short passes are padded to a few fixed widths
(`PASS_WIDTHS`), one graph per width, whatever the draft length (`graph_shapes`), and `warm_up`
compiles them all before a generation. The eager path is the same function uncompiled: the plain
reference the tests compare against. With VIASD_CHECK_GRAPH_OUTPUTS=1 every compiled call poisons
the outputs of the earlier ones, as CUDA graph trees may overwrite them (graph_outputs.py): a CPU
run then shows a stale read."""

from __future__ import annotations

import contextlib
import time

import torch

from viasd_core.runtime import graph_outputs
from viasd_core.runtime.pass_widths import PASS_WIDTHS


class CompiledPasses:
    """Mixed into FastModel (model.py): uses its cache, `_traced_run`, `forward` and `reset`."""

    def compile(self, mode: str | None = "default", dynamic: bool = False) -> bool:
        """torch.compile the pass function (fullgraph, static shapes); False where it cannot apply.
        `dynamic`: the pass's row count dynamic instead (an experiment: benchmarks/experiments/frozen_compile.py).

        bitsandbytes layers are not traceable: quantized models stay eager. int8/int4 models stay
        eager on CPU: there inductor's graphs round a position differently with the pass's width
        (a 1-token graph vs wider ones, up to 0.3 in a logit of SmolLM2), which would break sd ==
        ar, while the eager pass with `row_attention` is exact and as fast (int4 SmolLM2: 16.0 ms a
        token eager, 15.1 ms for the compiled 2-token pass that would be needed). On CUDA the
        default mode is "reduce-overhead" (CUDA graphs).
        """
        if not self.compilable:
            return False
        if mode == "default" and self.device.type == "cuda":
            mode = "reduce-overhead"
        self.compile_mode, self.compile_dynamic = mode, dynamic
        # Every FastModel shares `_run`'s code, whose graphs dynamo caches together: a session holds
        # up to 14 a model (the widths x one or all logit rows, token trees' masked passes), and a
        # calibration compiles a slim model per candidate view; the default limit of 8 refuses most.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
        # The cache's buffers are inputs mutated in place, never outputs: the output check spares them.
        self._compiled = graph_outputs.guard(torch.compile(self._traced_run, fullgraph=True, dynamic=dynamic, mode=mode),
                                             static=list(self.cache.buffers()))
        return True

    def uncompile(self) -> None:
        """Drop the compiled graphs: every pass runs eager again."""
        self._compiled = None
        self.compile_mode, self.compile_dynamic = None, False

    @property
    def compilable(self) -> bool:
        """Whether `compile` applies (see there): not bitsandbytes, not int8/int4 off CUDA."""
        return not (self.quantized or (self.weight_format and self.device.type != "cuda"))

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @contextlib.contextmanager
    def eager(self):
        """Run every pass eagerly inside the block; a compiled model keeps its graphs for after it
        (timing the two on the same model: machine/compile.py)."""
        compiled, self._compiled = self._compiled, None
        try:
            yield self
        finally:
            self._compiled = compiled
    def _compiled_pass(self, input_ids: torch.Tensor, start: int, T: int, W: int, n_logits: int) -> torch.Tensor:
        """A short pass padded to its fixed width W, attending over the whole cache (static shapes)."""
        # Padding tokens sit after the real ones: no real row attends to them. Always a new tensor
        # (made under inference mode), so every call hands the graph the same kind of input.
        input_ids = torch.cat([input_ids, input_ids.new_zeros(W - T)])
        pos = torch.arange(start, start + W, device=self.device)
        rows = torch.arange(T - 1, T, device=self.device) if n_logits == 1 else torch.arange(W, device=self.device)
        logits = self._compiled(input_ids, pos, rows, self.max_len)
        return logits if n_logits == 1 else logits[T - n_logits : T]

    @staticmethod
    def graph_shapes(max_width: int = PASS_WIDTHS[-1]) -> list[tuple[int, int]]:
        """(width, logit rows) of the compiled passes: every pass of up to 16 tokens. One logit row:
        a 1-token step or a catch-up padded to 2..16 (a draft after plain steps or accept tiers, the
        target after a block it did not verify, a chat turn); all rows: a verify block up to
        `max_width` (1 for a drafter's models). Over 16 tokens a pass stays an eager chunked prefill:
        its cost is in its positions, not in launches, and no fixed set of graphs covers every length."""
        return [(w, 1) for w in PASS_WIDTHS] + [(w, w) for w in PASS_WIDTHS[1:] if w <= max_width]

    def warm_up(self, max_width: int = PASS_WIDTHS[-1]) -> float:
        """Compile every graph of `graph_shapes(max_width)` now (none compiles mid-generation); returns seconds.

        Runs each shape once at positions 0.. (their cache entries are garbage, so the cache is
        emptied after). A no-op returning 0.0 when the model is not compiled.
        """
        if self._compiled is None:
            return 0.0
        t0 = time.perf_counter()
        ids = torch.zeros(PASS_WIDTHS[-1], dtype=torch.long, device=self.device)
        for width, n_rows in self.graph_shapes(max_width):
            self.forward(ids[:width], 0, n_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reset()
        self.passes = self.positions_run = 0
        return time.perf_counter() - t0
