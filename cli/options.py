"""Option definitions shared by the commands, and the one rule that turns an error into one line."""

from __future__ import annotations

import functools
import os
from typing import Annotated, Optional

import typer

from viasd_core.errors import ViasdError

DEFAULT_MODEL = "smollm2-135m"

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="Target: a local folder, a hub repo id (from the local cache), or 'smollm2-135m' (embedded)."),
]
DraftOpt = Annotated[
    Optional[str],
    typer.Option("--draft", "-d", help="Draft: a model reference, 'ngram' (prompt lookup), REF+ngram (lookup where the text repeats, the model elsewhere), or 'auto' (the best known for the target)."),
]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hub revision (branch, tag or commit) of the target.")]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU).")
]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda or cuda:N (default: cuda if available).")]
QuantOpt = Annotated[str, typer.Option("--quant", help="Target quantization: none, 8bit or 4bit (bitsandbytes).")]
DraftQuantOpt = Annotated[str, typer.Option("--draft-quant", help="Draft quantization: none, 8bit or 4bit.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the model repo (off by default).")]
AllowPickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow pickle (.bin) weights (off by default: safetensors only).")]
ModeOpt = Annotated[str, typer.Option("--mode", help="ar (plain), sd (two-tier, exact), exact (multi-tier, exact) or viasd (three tiers, calibrated, lossy).")]
GammaOpt = Annotated[int, typer.Option("--gamma", "-g", help="Draft tokens per step (the largest when adaptive).")]
AdaptiveOpt = Annotated[bool, typer.Option("--adaptive/--fixed", help="Adapt gamma to the acceptance (default) or keep it fixed.")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Largest number of new tokens per prompt.")]
TempOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy (default); > 0 samples.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens when sampling (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1] (1 = off).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (reproducible runs).")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")]
ProfileOpt = Annotated[Optional[str], typer.Option("--profile", help="Calibration profile file (default: the one saved for this pair).")]


def report_error(error: BaseException) -> int:
    """Print `error` as one line on stderr and return its exit code; with VIASD_DEBUG set, re-raise
    it instead (the traceback). A ViasdError is its own message; anything else names its type."""
    if os.environ.get("VIASD_DEBUG"):
        raise error
    if isinstance(error, ViasdError):
        typer.echo(f"Error: {error.message}", err=True)
        return error.exit_code
    typer.echo(f"Error: {type(error).__name__}: {error} (set VIASD_DEBUG=1 for the traceback)", err=True)
    return 1


def handle_errors(fn):
    """Turn a ViasdError raised by a command into its one line and exit code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ViasdError as e:
            raise typer.Exit(report_error(e))

    return wrapper
