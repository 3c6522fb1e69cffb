"""What the commands share: option definitions, the model and generation option groups (each
declared once, passed to a command as one ModelOptions / GenerationConfig), and the one rule that
turns an error into one line."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Annotated, Optional

import typer

from viasd_core.machine.compile import parse_compile
from viasd_core.speculation import exactness
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.errors import ViasdError
from viasd_core.loading.models import EMBEDDED_TARGET
from viasd_core.session import GenerationRequest, Session, build_session, resolve_config
from viasd_core.machine.threads import parse_threads
from viasd_core.machine.tree import parse_tree
from viasd_core.loading.options import ModelOptions

DEFAULT_MODEL = EMBEDDED_TARGET

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="Target: a local folder, a .gguf file (converted once; weights dequantized), a hub repo id (downloaded into the HF cache on first use, as `viasd pull`), or 'smollm2-135m' (embedded)."),
]
DraftOpt = Annotated[
    Optional[str],
    typer.Option("--draft", "-d", help="Draft: a model reference (as --model; a hub id at its main revision), 'ngram' (prompt lookup), 'suffix' (a suffix index over this conversation and earlier requests: drafts that remember), REF+ngram or REF+suffix (that lookup where the text repeats, the model elsewhere), or 'auto' (the best draft in the cache for the target: a published head, then a draft model, then ngram; --verbose says which and why)."),
]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hub revision (branch, tag or commit) of the target.")]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU).")
]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda or cuda:N (default: cuda if available).")]
QuantOpt = Annotated[str, typer.Option("--quant", help="Target weights: auto (on a CPU, for the embedded model, the fastest of none, int8 and int4 on this machine, timed once and cached; else none), none, int8 or int4 (weight-only, packed by torchao; bf16 activations), gguf (a .gguf file's own Q4_0/Q4_1/Q4_K blocks run as int4, its other layers int8), 8bit or 4bit (bitsandbytes LLM.int8 / NF4). Greedy sd and exact emit ar's tokens bit for bit on a CPU at none (float32), int8 and int4; at 8bit/4bit, compiled, or on a GPU, up to the kernels' rounding (a near-tie may flip; on one H200 every tiny-model case tried was identical). viasd doctor says which applies.")]
DraftQuantOpt = Annotated[str, typer.Option("--draft-quant", help="Draft weights: none, int8, int4, 8bit or 4bit (as --quant).")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the model repo (off by default).")]
AllowPickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow pickle (.bin) weights (off by default: safetensors only).")]
ModeOpt = Annotated[str, typer.Option("--mode", help="ar (plain), sd (two-tier, exact), exact (multi-tier, exact) or viasd (three tiers, calibrated, lossy).")]
GammaOpt = Annotated[Optional[int], typer.Option("--gamma", "-g", help="Draft tokens per step: the first block when adaptive (then it follows acceptance, up to 12, or this if larger), every block with --fixed. Default for sd: the fastest chain measured on this machine (at least 2, and the adaptive block's floor; cached, --verbose says why); 5 elsewhere.")]
AdaptiveOpt = Annotated[bool, typer.Option("--adaptive/--fixed", help="Adapt the draft length to acceptance and measured cost, with plain steps while drafting does not pay (default), or keep gamma fixed.")]
MinConfidenceOpt = Annotated[float, typer.Option("--min-confidence", help="With --adaptive, a model draft stops before the token where its own estimate that the whole block is accepted (the product of its top probabilities) falls below this; 0 = off.")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Largest number of new tokens per prompt.")]
TempOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy (default); > 0 samples.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens when sampling (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1] (1 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="When sampling, drop tokens less likely than this fraction of the most likely one, in [0, 1] (0 = off).")]
RepetitionPenaltyOpt = Annotated[float, typer.Option("--repetition-penalty", help="Penalize tokens already in the context (prompt and output so far): a positive logit is divided by this, a negative one multiplied (transformers' and vLLM's rule); > 0, 1 = off. Changes greedy answers too; exact in every mode.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (reproducible runs).")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")]
ProfileOpt = Annotated[Optional[str], typer.Option("--profile", help="Calibration profile file (default: the one saved for this pair).")]
MaxContextOpt = Annotated[Optional[int], typer.Option("--max-context", help="Positions every KV cache holds, allocated once (default: the model's context, at most 4096, within a quarter of free memory).")]
CompileOpt = Annotated[str, typer.Option("--compile", help="torch.compile the decoding passes: auto (on CUDA, with CUDA graphs; on a CPU where `viasd doctor` timed it faster), on, off (eager).")]
ThreadsOpt = Annotated[str, typer.Option("--threads", help="CPU threads for the passes: auto (the fastest of a few counts, timed at start-up: a busy machine gets fewer) or a count.")]
TreeOpt = Annotated[str, typer.Option("--tree", help="sd's draft token trees (an EAGLE-3 head draft): auto (the size that measures fastest on this machine, measured once and cached), off (chains), or a node count 1-15.")]


def _option_group(options: dict[str, tuple[object, object]], name: str, build):
    """A decorator that gives a command the `options` (parameter -> (Annotated type, default)) in
    place of its parameter `name`, which receives `build(**their values)`."""

    def decorate(command):
        own = inspect.signature(command, eval_str=True)
        params = []
        for param in own.parameters.values():
            if param.name == name:
                params += [inspect.Parameter(option, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint)
                           for option, (hint, default) in options.items()]
            else:
                params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(command)
        def wrapper(**kwargs):
            value = build(**{option: kwargs.pop(option) for option in options})
            return command(**kwargs, **{name: value})

        wrapper.__signature__ = own.replace(parameters=params)  # what Typer reads
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


MODEL_OPTIONS = {
    "model": (ModelOpt, DEFAULT_MODEL), "draft": (DraftOpt, None), "revision": (RevisionOpt, None),
    "dtype": (DtypeOpt, None), "device": (DeviceOpt, None), "quant": (QuantOpt, "auto"),
    "draft_quant": (DraftQuantOpt, "none"), "trust_remote_code": (TrustOpt, False),
    "allow_pickle": (AllowPickleOpt, False), "profile": (ProfileOpt, None),
    "max_context": (MaxContextOpt, None), "compile": (CompileOpt, "auto"), "tree": (TreeOpt, "auto"),
    "threads": (ThreadsOpt, "auto"),
}


def model_options(command=None, *, profile=ProfileOpt):
    """Give `command` the model options (--model ... --compile), passed to it as `opts: ModelOptions`.
    `@model_options(profile=...)`: a command that writes the profile declares its own --profile."""
    decorate = _option_group({**MODEL_OPTIONS, "profile": (profile, None)}, "opts", ModelOptions)
    return decorate if command is None else decorate(command)


def _generation_config(stop, gamma, **values) -> GenerationConfig:
    config = GenerationConfig(stop=tuple(stop or ()), gamma=GenerationConfig.gamma if gamma is None else gamma,
                              auto_gamma=gamma is None, **values)
    if config.mode != "viasd":  # viasd needs the profile's thresholds: open_session validates it
        config.validate()  # fail fast, before loading models
    return config


def generation_options(max_new_tokens: int):
    """Give a command the generation options (--mode ... --stop), passed to it as `config: GenerationConfig`."""
    return _option_group(
        {"mode": (ModeOpt, "sd"), "gamma": (GammaOpt, None), "adaptive": (AdaptiveOpt, True),
         "min_confidence": (MinConfidenceOpt, GenerationConfig.min_confidence),
         "max_new_tokens": (MaxNewOpt, max_new_tokens), "temperature": (TempOpt, 0.0), "top_k": (TopKOpt, 0),
         "top_p": (TopPOpt, 1.0), "min_p": (MinPOpt, 0.0),
         "repetition_penalty": (RepetitionPenaltyOpt, 1.0), "seed": (SeedOpt, None), "stop": (StopOpt, None)},
        "config", _generation_config,
    )


def open_session(opts: ModelOptions, config: GenerationConfig, progress,
                 long_lived: bool = False) -> tuple[Session, GenerationConfig]:
    """The session for `config.mode` (the options as parsed), and a new config resolved on it
    (session.resolve_config: the profile's thresholds, sd's draft trees and first block), validated:
    the command runs that one; `config` is left as it was.
    `long_lived`: a server's session (compiling at start-up may pay on a CPU: machine/compile.py)."""
    parse_tree(opts.tree)  # fail fast, before loading models
    parse_threads(opts.threads)
    parse_compile(opts.compile)
    session = build_session(opts, mode=config.mode, progress=progress, long_lived=long_lived)
    resolved = resolve_config(session, GenerationRequest.of(config), progress)
    if progress and resolved.tree is not None:
        progress(f"draft trees of {resolved.tree.size} tokens ({session.tree.reason})")
    resolved.validate()
    if progress and (note := exactness.note(session.engine.target, resolved.mode)):
        progress(note)
    return session, resolved


class StderrLog:
    """The `progress` a command hands the core: each message one line on stderr (none with `quiet`);
    `status(text)`, a transient spinner while a model loads (loading.models.loading_status), is drawn
    only where stderr is a terminal: a pipe or a log file gets no spinner frames, and the lines
    stay the ones the command prints. Download bars follow `quiet` (hub_pull)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            typer.echo(message, err=True)

    def status(self, text: str):
        console = stderr_console()
        if self.quiet or not console.is_terminal:
            return contextlib.nullcontext()
        return console.status(text)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


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
