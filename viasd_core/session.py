"""From command-line options to a ready Engine (target, draft, slim verifier, profile), and from what
a front end asks (a GenerationRequest) to the GenerationConfig the engine runs on that session
(`resolve_config`, the one place the session's measured decisions reach a config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from viasd_core import cpu_isa
from viasd_core.speculation import exactness
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.speculation.grammar import Grammar
from viasd_core.errors import UsageError, ViasdError
from viasd_core.loading.models import Loaded, eos_ids, forget_format, load_model
from viasd_core.devices import free_memory_bytes, resolve_device, usable_cores
from viasd_core.runtime.model import FastModel
from viasd_core.machine.short_rows import choose_rows
from viasd_core.loading.drafter_factory import draft_choice, load_drafter
from viasd_core.loading.options import DEFAULT_CONTEXT_CAP, ModelOptions
from viasd_core.loading.prompts import probe_prompts
from viasd_core.loading.profile import Profile, find_profile
from viasd_core.loading.vocab_rows import cap_vocab, token_rows, tokenizer_size
from viasd_core.speculation.router import Thresholds
from viasd_core.runtime.slim_view import TARGET_WEIGHTS, slim_verifier, twin_bytes
from viasd_core.machine import first_block as first_blocks
from viasd_core.machine import format as formats
from viasd_core.machine import threads as threads_choice
from viasd_core.machine import tree as tree_choice
from viasd_core.machine.compile import DECISION as COMPILE, CompileChoice, resolve_compile
from viasd_core.machine.profile import SHORT_ROWS, MachineProfile
from viasd_core.machine.threads import ThreadChoice, resolve_threads
from viasd_core.machine.tree import TreeChoice, measure_verify_curve, resolve_tree

@dataclass
class Session:
    engine: Engine
    target: Loaded
    draft_id: str  # 'ngram', 'none' or the draft model's id
    draft: Loaded | None
    profile: Profile | None
    options: ModelOptions
    machine: MachineProfile  # the machine decisions, in their order (machine/profile.py)
    compile_seconds: float | None = None  # time spent compiling at start-up (None: eager)
    draft_reason: str = ""  # why this draft (--draft auto's choice: draft_choice.py), "" with none loaded

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def threads(self) -> ThreadChoice | None:
        """--threads as resolved at start-up (machine/threads.py)."""
        return self.machine.result("threads")

    @property
    def short_rows_reason(self) -> str:
        """Why short float32 passes take the products they take (runtime/short_products.py)."""
        entry = self.machine.resolved.get("short-rows")
        return entry.reason if entry else ""

    @property
    def compile(self) -> CompileChoice | None:
        """--compile as resolved at start-up (machine/compile.py)."""
        return self.machine.result("compile")

    @property
    def tree(self) -> TreeChoice | None:
        """sd's draft trees, once `choose_tree` resolved --tree (machine/tree.py)."""
        return self.machine.result("tree")

    @property
    def first_block(self) -> tuple[int, str] | None:
        """sd's first block and why, where the user gave no -g (`choose_first_block`)."""
        return self.machine.result("first-block")

    def first_block_record(self) -> dict | None:
        """sd's first block without -g and why, JSON-ready (bench's meta, doctor); None before chosen."""
        return None if self.first_block is None else {"gamma": self.first_block[0], "reason": self.first_block[1]}

    def choices(self) -> list[tuple[str, str, str]]:
        """What the session chose where the user left it to viasd, and why: (setting, value, reason)
        for the machine decisions resolved so far, in their order (machine/profile.py: the weight format, the
        CPU threads, the short-pass product, compilation, sd's draft trees and first block), the draft,
        and the exactness and instruction set that follow from them."""
        out = self.machine.choices()
        if self.draft_reason:
            out.insert(1, ("draft", self.draft_id, self.draft_reason))
        promise = exactness.promise(self.engine.target)
        out.append(("exactness", "bit-exact" if promise.exact else "up to rounding", promise.why))
        if self.engine.target.device.type == "cpu":
            out.append(("instruction set", *cpu_isa.in_force()))
        return out


def build_session(opts: ModelOptions, mode: str = "sd", progress=None, need_profile: bool | None = None,
                  refresh: bool = False, long_lived: bool = False) -> Session:
    """The session for `opts` and `mode`. `refresh`: measure again what is measured once per machine
    and cached (`--quant auto`'s format, the short-pass product, `--compile auto`; `viasd doctor`).
    `long_lived`: the session serves many requests (`viasd serve`; machine/compile.py)."""
    if refresh and str(opts.quant).strip().lower() == "auto":
        forget_format(opts.model, opts.device)
    machine = MachineProfile(resolve_device(opts.device))
    # the machine's decisions in their order (machine/profile.py): --quant auto's is made as the target loads
    target = machine.resolve(formats.DECISION, lambda: load_model(
        opts.model, dtype=opts.dtype, device=opts.device, revision=opts.revision, trust_remote_code=opts.trust_remote_code,
        allow_pickle=opts.allow_pickle, quant=opts.quant, progress=progress), _format_shown)
    # --quant parsed once by load_model (`auto` resolved): the value and its reason are target.format,
    # target.format_reason; the options keep its spelling, the key of profiles
    opts = dataclasses.replace(opts, quant=target.quant)
    max_context = context_size(target.model, opts.max_context, progress)
    target_fast = FastModel(target.model, max_len=max_context, name="target")
    cap_vocab(target_fast, token_rows(target.model))
    cap_vocab(target_fast, tokenizer_size(target.tokenizer))
    drafter, draft_id, draft, draft_reason = (None, "none", None, "")
    if mode != "ar" or opts.draft not in (None, "auto"):
        choice = draft_choice(opts, target)  # decided once: auto's reason is kept for --verbose
        draft_reason = choice.reason
        drafter, draft_id, draft = load_drafter(dataclasses.replace(opts, draft=choice.ref), target, target_fast, progress)
    profile = None
    slim = None
    if need_profile is None:
        need_profile = mode in ("exact", "viasd")
    if need_profile:
        profile, slim = pair_profile(target, draft_id, opts, target_fast, progress)
    engine = Engine(target_fast, target.tokenizer, drafter=drafter, slim=slim, eos_token_ids=eos_ids(target),
                    context_len=max_context)
    session = Session(engine, target, draft_id, draft, profile, opts, machine, draft_reason=draft_reason)
    # before compiling (inductor's CPU kernels keep the thread count they were built with) and before
    # --tree auto measures anything
    machine.resolve(threads_choice.DECISION, lambda: resolve_threads(opts.threads, engine.device, lambda repeats: sum(
        measure_verify_curve(engine, widths=(1, 4), context=16, repeats=repeats).values())),
        lambda chosen: (str(chosen.threads), chosen.reason))
    if progress and session.threads.busy:  # said when a busy machine made auto use fewer than its cores
        progress(f"CPU threads: {session.threads.threads} of {usable_cores()} ({session.threads.reason})")
    # at the thread count just chosen: the blocked float32 product pays with two threads and more
    rows_key = {"target": target.model_id, "draft": draft_id, "format": opts.quant,
                "dtype": str(target_fast.dtype).replace("torch.", "")}
    machine.resolve(SHORT_ROWS, lambda: choose_rows(engine, rows_key, refresh),
                    lambda chosen: (engine.target.pass_rows.describe(), chosen[1]))
    # a compiled pass attends over the whole cache: its cost depends on the context too
    machine.resolve(COMPILE, lambda: apply_compile(engine, opts.compile, {**rows_key, "context": max_context},
                                                   measure=refresh, long_lived=long_lived, progress=progress),
                    lambda chosen: (f"on ({', '.join(engine.compiled_models)})" if engine.compiled_models else "off",
                                    chosen.reason))
    if engine.compiled:
        if progress:
            progress("compiling the decoding graphs (torch.compile; cached for later runs)...")
        session.compile_seconds = engine.warm_up()
        if progress:
            progress(f"compiled the decoding graphs ({', '.join(engine.compiled_models)}) in {session.compile_seconds:.1f} s")
    return session


def choose_tree(session: Session, progress=None, refresh: bool = False) -> TreeChoice:
    """Resolve --tree for the session's sd steps (measured and cached for `auto`: machine/tree.py)
    and compile the tree's graphs when the engine is compiled."""
    key = {"target": session.target.model_id, "draft": session.draft_id, "format": session.options.quant,
           "dtype": str(session.engine.target.dtype).replace("torch.", ""), "compiled": session.engine.compiled,
           "threads": torch.get_num_threads()}
    choice = session.machine.resolve(tree_choice.DECISION, lambda: resolve_tree(
        session.engine, probe_prompts(session.tokenizer), session.options.tree, key, progress, refresh),
        lambda chosen: (f"{chosen.shape.size} tokens" if chosen.shape else "chains", chosen.reason))
    if choice.shape is not None and session.engine.compiled:
        session.engine.warm_up_tree(choice.shape)
    return choice


def choose_first_block(session: Session, gamma_max: int, progress=None) -> int | None:
    """sd's first block (and floor) where the user gave no -g: the fastest chain of --tree auto's
    probe on this machine (measured once and cached: `choose_tree`; machine/first_block.py says
    the rule); None where nothing was measured (GenerationConfig's defaults then hold).
    `session.first_block` says which and why either way."""
    choice = session.tree or choose_tree(session, progress)
    best = choice.best_chain()
    start, _ = session.machine.resolve(first_blocks.DECISION, lambda: first_blocks.first_block(best, gamma_max),
                                       lambda chosen: (f"{chosen[0]} drafts", chosen[1]))
    return None if best is None else start


# ---------------------------------------------------------------------- what a front end asks
@dataclass(frozen=True)
class GenerationRequest:
    """What a front end asks of its generations beyond the model options: the mode, the token budget,
    the block length, the sampling, and whether sd takes this machine's measured decisions (its draft
    trees, its first block). `resolve_config` turns it, on a built session, into a new GenerationConfig;
    being frozen, one request can serve several configs (bench's methods, doctor's probe)."""

    mode: str = "sd"
    max_new_tokens: int = GenerationConfig.max_new_tokens
    gamma: int | None = None  # None: no block length given (sd then starts as `measured_start` says)
    adaptive: bool = GenerationConfig.adaptive
    min_confidence: float = GenerationConfig.min_confidence
    temperature: float = GenerationConfig.temperature
    top_k: int = GenerationConfig.top_k
    top_p: float = GenerationConfig.top_p
    min_p: float = GenerationConfig.min_p
    repetition_penalty: float = GenerationConfig.repetition_penalty
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: Grammar | None = None
    # viasd's gates the front end brings itself (calibration's fit, bench's extra profiles); None: the
    # session profile's
    thresholds: Thresholds | None = None
    # sd drafts the trees --tree resolves to on this machine; False: chains (bench's sd, doctor's
    # probe, calibration, the campaign's evaluation)
    trees: bool = True
    # without gamma, sd without trees starts at the block measured fastest here (machine/first_block.py);
    # False: at GenerationConfig's default (the campaign's evaluation)
    measured_start: bool = True

    @classmethod
    def of(cls, config: GenerationConfig) -> GenerationRequest:
        """The request the command-line options were parsed into: the CLI parses them into a
        GenerationConfig so that a bad value fails before any model loads (cli/options.py); no -g
        (`auto_gamma`) reads as gamma None."""
        asked = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)}
        return cls(**{**asked, "gamma": None if config.auto_gamma else config.gamma})


def resolve_config(session: Session, asked: GenerationRequest | GenerationConfig, progress=None,
                   refresh: bool = False) -> GenerationConfig:
    """The GenerationConfig the engine runs for `asked` on this session: the request's settings;
    viasd's thresholds (the request's own, else the session profile's); and for sd, the machine's
    decisions the request takes: the draft trees --tree resolves to (`choose_tree`: resolved once per
    session, `refresh` measures them again, doctor's probe) and, with no gamma and no trees, the first
    block measured on this machine (`choose_first_block`). `progress` hears --tree auto's probe.

    Every call returns a new config and changes nothing the caller holds. A config resolved before
    (`asked` a GenerationConfig: a server's, opened before the pair's profile was attached) comes back
    as a copy holding the session profile's thresholds, its other settings kept. The config is not
    validated here: the CLI validates it before a model runs, and the engine every config it runs."""
    if isinstance(asked, GenerationConfig):
        return dataclasses.replace(asked, thresholds=thresholds_of(session.profile))
    wishes = ("trees", "measured_start")
    settings = {f.name: getattr(asked, f.name) for f in dataclasses.fields(asked) if f.name not in wishes}
    config = GenerationConfig(**{
        **settings, "gamma": GenerationConfig.gamma if asked.gamma is None else asked.gamma,
        "auto_gamma": asked.gamma is None,
        "thresholds": asked.thresholds if asked.thresholds is not None else thresholds_of(session.profile)})
    measured_start = asked.gamma is None and asked.measured_start
    if config.mode == "sd" and (asked.trees or measured_start):
        choice = session.tree if session.tree is not None and not refresh else choose_tree(session, progress, refresh)
        config.tree = choice.shape if asked.trees else None
        if measured_start and config.tree is None:
            measured = choose_first_block(session, config.gamma_max)
            if measured is not None:
                config.start_at_measured(measured)
    return config


def _format_shown(target: Loaded) -> tuple[str, str]:
    fmt = str(target.format)
    return fmt, target.format_reason.removeprefix(f"{fmt}: ")


def pair_profile(target: Loaded, draft_id: str, opts: ModelOptions, target_fast: FastModel, progress=None):
    """The calibration profile of the pair (opts.profile, else the one calibrate saved for it) and
    the slim verifier its view describes: (Profile, FastModel). ViasdError when there is none."""
    profile = find_profile(target.model_id, draft_id, opts.quant, target_fast.device.type, target_fast.shape.n_layers,
                           explicit=opts.profile)
    slim = slim_verifier(target_fast, profile.view)
    if progress and profile.view.weights != TARGET_WEIGHTS:
        progress(f"slim view: {profile.view.describe(target_fast.shape.n_layers)} "
                 f"({twin_bytes(target.model, profile.view.weights) / 2**20:.0f} MiB beside the target's weights)")
    return profile, slim


def attach_profile(session: Session, progress=None) -> None:
    """Give a running session its pair's profile and slim verifier (chat and the server, when a
    calibrated mode is first asked for)."""
    session.profile, session.engine.slim = pair_profile(session.target, session.draft_id, session.options,
                                                        session.engine.target, progress)


# ---------------------------------------------------------------------- context and compilation
def context_size(hf_model, requested: int | None, progress=None) -> int:
    """Positions every KV cache is allocated for: --max-context, or the model's own context capped
    at DEFAULT_CONTEXT_CAP and at what a quarter of free memory holds (target, slim and draft caches).
    A cap below the model's own context is said through `progress`, with how to raise it."""
    from viasd_core.runtime.model import model_shape

    shape = model_shape(hf_model)
    param = next(hf_model.parameters())
    elem = param.element_size() if param.dtype.is_floating_point else 4
    per_position = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * elem * 3  # target + slim + draft, at most
    free = free_memory_bytes(param.device)
    if requested is not None:
        if requested < 16:
            raise UsageError(f"--max-context must be at least 16, got {requested}")
        if requested > shape.max_positions:
            why = f": {shape.positions_why}" if shape.positions_why else ""
            raise UsageError(f"--max-context {requested} exceeds the model's context ({shape.max_positions} positions{why})")
        if requested * per_position > 0.9 * free:
            raise ViasdError(
                f"KV caches for --max-context {requested} need {requested * per_position / 2**30:.1f} GiB but only "
                f"{free / 2**30:.1f} GiB is free on {param.device.type}: lower --max-context"
            )
        return int(requested)
    fits = int(0.25 * free // per_position)
    size = max(16, min(shape.max_positions, DEFAULT_CONTEXT_CAP, fits))
    if size < shape.max_positions and progress:
        amount = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.0f} MiB"
        cap = f"what a quarter of the {amount} free on {param.device.type} holds" if fits < DEFAULT_CONTEXT_CAP else "the default cap"
        progress(f"context: {size} positions ({cap}; the model's own is {shape.max_positions}): "
                 "raise it with --max-context")
    return size


def apply_compile(engine: Engine, choice: str, key: dict, measure: bool = False, long_lived: bool = False,
                  progress=None) -> CompileChoice:
    """Decide --compile for the engine (machine/compile.py; `measure`: time this machine again) and
    torch.compile its models' passes where the choice is on."""
    decided = resolve_compile(engine.target, choice, key, measure, long_lived, progress)
    if decided.on:
        engine.compile()
    return decided


def thresholds_of(profile: Profile | None) -> Thresholds | None:
    return Thresholds(profile.theta_accept, profile.theta_slim, profile.theta_confidence) if profile else None
