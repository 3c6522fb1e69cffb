"""`--compile auto|on|off`: whether the decoding passes run through torch.compile, decided per machine.

On CUDA `auto` compiles: CUDA graphs remove the launch overhead that dominates the small passes
of decoding. On a CPU there is no launch overhead to remove, and a compiled pass pads a short pass
to a fixed width and attends over the whole cache (its static shapes): on our development CPU the
compiled `sd` was 5% slower than the eager one (docs/experiments/compiled-sync-free-step.md). Which wins depends
on the CPU, so there `auto` stays eager until this machine has been measured: `viasd doctor` times
the target's 1-token and 4-token passes eager and compiled (compiling the two graphs first: a whole
`viasd doctor --quant none` took 2 min 25 s on our 2-core CPU; inductor caches the kernels on disk) and
caches the verdict under the user's cache
folder, per machine, model, weight format, dtype, context and thread count. Where that verdict
found the compiled passes faster, a long-lived `auto` session (`viasd serve`, and `viasd doctor`,
which checks what a server would run) compiles; a one-off
command stays eager, since compiling the session's graphs costs a minute or more at start-up even
with inductor's cache warm (61 s to 315 s for the embedded target on our 2-core CPU), which
saving ~5 ms a token wins back only after some 12,000 tokens (docs/experiments/startup-compile-first-block.md).
int8/int4 passes on a CPU and bitsandbytes layers never compile (runtime/model.py:
FastModel.compile), so nothing is measured for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from viasd_core.runtime.model import FastModel
from viasd_core.runtime.pass_timing import time_passes
from viasd_core.errors import UsageError
from viasd_core.machine.record import Decision

COMPILE_CHOICES = ("auto", "on", "off")

WIDTHS = (1, 4)  # a plain step and a typical verify pass
CONTEXT = 128
REPEATS = 5
ROUNDS = 3
MARGIN = 0.05  # compiled must be this much faster: it costs start-up time and pads odd widths


@dataclass
class CompileChoice:
    """What `--compile` resolved to and why (shown by doctor and --verbose)."""

    on: bool
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)  # "eager"/"compiled" -> 1-token + 4-token pass (measured only)


def parse_compile(choice: str) -> str:
    """The --compile value, or a UsageError naming the choices."""
    if choice not in COMPILE_CHOICES:
        raise UsageError(f"unknown --compile '{choice}': use auto, on or off")
    return choice


def resolve_compile(model: FastModel, choice: str, key: dict, measure: bool = False, long_lived: bool = False,
                    progress=None, timer: Callable[[FastModel], dict[str, float]] | None = None) -> CompileChoice:
    """Whether a session compiles, for `--compile choice` and the session's target `model`. `key`
    names the model, format and context (the cache key, with the machine's identity); `measure`
    times this machine again (`viasd doctor`) where the answer depends on it; `long_lived`: the
    session serves many requests (`viasd serve`), so compiling at start-up can pay on a CPU."""
    parse_compile(choice)
    if choice == "off":
        return CompileChoice(False, "--compile off")
    if not model.compilable:
        return CompileChoice(False, "int8/int4 layers on a CPU and bitsandbytes layers run eager (exact, as fast)")
    if choice == "on":
        return CompileChoice(True, "--compile on")
    if model.device.type == "cuda":
        return CompileChoice(True, "auto: on CUDA, compiled passes with CUDA graphs")
    record = DECISION.record(model.device, key)
    if not measure:
        cached = record.read(lambda data: CompileChoice(bool(data["on"]), data["reason"] + " (cached)", data["seconds"]))
        if cached is not None:
            return _for_session(cached, long_lived)
        if not record.exists():
            return CompileChoice(False, "auto: eager, since compiling was not timed on this machine yet "
                                        "(`viasd doctor` with the same --quant and --max-context times it)")
        return CompileChoice(False, "auto: eager (the cached timing could not be read; `viasd doctor` times it again)")
    if progress:
        progress("timing eager and compiled passes on this machine for --compile auto (compiles two graphs; cached)...")
    seconds = (timer or time_compiled)(model)
    on = seconds["compiled"] < seconds["eager"] * (1 - MARGIN)
    shown = f"eager {seconds['eager'] * 1e3:.1f} ms, compiled {seconds['compiled'] * 1e3:.1f} ms for a 1-token plus a 4-token pass"
    reason = (f"auto: compiled, over {MARGIN:.0%} faster here ({shown})" if on
              else f"auto: eager, compiled is not {MARGIN:.0%} faster here ({shown})")
    record.store({"on": on, "reason": reason, "seconds": seconds})
    return _for_session(CompileChoice(on, reason, seconds), long_lived)


def _for_session(verdict: CompileChoice, long_lived: bool) -> CompileChoice:
    """A CPU's measured verdict as one session takes it: compiled only where the session is long-lived."""
    if not verdict.on or long_lived:
        return verdict
    return CompileChoice(False, "auto: eager for a one-off command: compiling takes a minute or more at start-up "
                                f"(`viasd serve` compiles here; `--compile on` forces it). Timed: {verdict.reason}",
                         verdict.seconds)


def time_compiled(model: FastModel) -> dict[str, float]:
    """Seconds of `model`'s 1-token plus 4-token pass, eager and compiled: the two graphs compiled
    first, then ROUNDS rounds each timing both in turn, each keeping its best round (a burst of load
    on a shared machine slows one round, not one way). The model is left as it came (compiled or not)."""
    was_compiled = model.compiled
    model.compile()
    time_passes(model, WIDTHS, CONTEXT, repeats=1)  # compiles the graphs timed below
    best = {"eager": float("inf"), "compiled": float("inf")}
    for _ in range(ROUNDS):
        with model.eager():
            best["eager"] = min(best["eager"], sum(time_passes(model, WIDTHS, CONTEXT, REPEATS).values()))
        best["compiled"] = min(best["compiled"], sum(time_passes(model, WIDTHS, CONTEXT, REPEATS).values()))
    if not was_compiled:
        model.uncompile()
    return best


DECISION = Decision("compile", "--compile auto", 1, time_compiled,
                    "whether the decoding passes run compiled: on CUDA yes; on a CPU where doctor timed the compiled "
                    "1- plus 4-token passes 5% faster than eager, and only for a long-lived session")
