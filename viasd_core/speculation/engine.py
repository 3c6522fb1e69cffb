"""The decoding loop over four modes: ar (plain), sd (two-tier, exact), exact (multi-tier, exact),
viasd (three tiers). Each mode's step lives in steps.py, chosen once per generation.

A generation, in order:
  prefill   every model that will run reads the prompt up to its last token (a slim verifier the
            mode never runs is not prefilled)
  steps     the mode's step (draft, route, verify, accept: steps.py), or a plain step when the draft
            policy measures plain steps faster (draft_policy.py); each returns a StepResult
  commit    the engine's one commit: the host copy of the tokens, every KV cache rolled back to
            what it saw correctly (a length reset: the caches are static, see model.FastModel)
  adapt     the draft policy learns the step's tokens and wall time
  observe   observers (calibration's recorder, chat's live meter) see the StepResult; none by default
  emit      EOS, the token budget and stop strings end the generation

A step reads the device once in ar, sd and exact (`read`, counted in `host_reads`); viasd routes on
the host. Phase timings need synchronizations: they are taken only when `breakdown` is on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from viasd_core.speculation.draft_policy import FLOOR, UNMEASURED_START, DraftPolicy
from viasd_core.speculation.drafters import Drafter
from viasd_core.speculation.grammar import Constraint, Grammar
from viasd_core.runtime.model import PASS_WIDTHS, FastModel
from viasd_core.speculation.router import Thresholds
from viasd_core.speculation.sampling import Sampler, SamplingParams
from viasd_core.speculation.stats import RunStats
from viasd_core.speculation.tree import TreeShape
from viasd_core.speculation.steps import Run, StepResult, common_prefix, plain_step, plan_for
from viasd_core.errors import UsageError, ViasdError

MODES = ("ar", "sd", "exact", "viasd")


@dataclass
class GenerationConfig:
    mode: str = "sd"
    max_new_tokens: int = 128
    gamma: int = UNMEASURED_START
    # True where the user gave no block length (the CLI without -g): open_session then sets `gamma`
    # to the first block measured on this machine for sd (machine/first_block.py)
    auto_gamma: bool = False
    adaptive: bool = True
    gamma_max: int = 12
    gamma_floor: int = FLOOR  # an adaptive block never shrinks below this (unless it started below)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # transformers' and vLLM's rule (sampling.penalize): every row's logits are penalized over that
    # row's own context, so it changes greedy choices too and stays exact in every mode (1 = off)
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    thresholds: Thresholds | None = None  # viasd mode
    # Adaptive only: a model draft stops before the token at which its own estimate that the whole
    # block is accepted (the product of its token probabilities) falls below this (0 = off, the
    # default: the stop at 0.15 kept blocks shorter than they pay, docs/experiments/short-pass-products-read-once.md).
    min_confidence: float = 0.0
    tree: TreeShape | None = None  # sd: draft token trees of this shape (None: chains)
    # The output must match this grammar (grammar.py): every mode but ar then runs constrained_step
    # (chains verified by the target alone); None: unconstrained, the steps above untouched.
    grammar: Grammar | None = None

    def validate(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"unknown mode '{self.mode}': use one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if self.gamma < 1:
            raise UsageError(f"gamma must be at least 1 (got {self.gamma}): pass --gamma 1 or more")
        if not 1 <= self.gamma_floor <= max(self.gamma, self.gamma_max):
            raise UsageError(f"the block floor must be between 1 and gamma_max (got {self.gamma_floor})")
        if max(self.gamma, self.gamma_max if self.adaptive else self.gamma) + 1 > PASS_WIDTHS[-1]:
            raise UsageError(f"gamma can be at most {PASS_WIDTHS[-1] - 1} (a verify pass covers gamma + 1 tokens)")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (got {self.temperature}); 0 means greedy")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"min-p must be in [0, 1] (got {self.min_p}); 0 turns it off")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise UsageError(f"repetition-penalty must be > 0 (got {self.repetition_penalty}); 1 turns it off")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (got {self.top_k}); 0 turns it off")
        if not 0 <= self.min_confidence < 1:
            raise UsageError(f"--min-confidence must be in [0, 1) (got {self.min_confidence}); 0 turns the stop rule off")
        if self.mode == "viasd" and self.temperature > 0:
            raise UsageError("viasd mode is greedy-only (its gates are calibrated for greedy decoding); use --mode sd or exact to sample")
        if self.tree is not None and self.tree.size + 1 > PASS_WIDTHS[-1]:
            raise UsageError(f"a draft tree holds at most {PASS_WIDTHS[-1] - 1} tokens (a verify pass covers size + 1)")
        if self.mode == "viasd" and self.thresholds is None:
            raise UsageError("viasd mode needs calibrated thresholds: run `viasd calibrate` first")

    def start_at_measured(self, block: int) -> None:
        """Start sd's blocks at the length measured fastest on this machine (the user gave no -g):
        an adaptive block then never shrinks below it either (machine/first_block.py)."""
        self.gamma = self.gamma_floor = block

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int]  # new tokens (EOS included when generation ended on it)
    tiers: list[str]  # per new token: ar / accept / slim / full / bonus
    text: str
    finish_reason: str  # eos, length, stop, interrupted, cancelled
    stats: RunStats = field(default_factory=RunStats)
    clipped_to: int | None = None  # max_new_tokens cut to what the context leaves after the prompt (None: kept)


class Engine:
    """Batch-1 generation over a target, an optional drafter and an optional slim verifier.

    The engine keeps the committed tokens across calls, so a follow-up prompt that extends
    the previous conversation re-uses every cached position (chat). Every cache is allocated
    once, for `context_len` positions.
    """

    def __init__(self, target: FastModel, tokenizer, drafter: Drafter | None = None, slim: FastModel | None = None,
                 eos_token_ids: set[int] | None = None, context_len: int | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.compiled = False
        self._slim = slim
        self._drafter = drafter
        self.eos = set(eos_token_ids or ())
        self.context_len = int(context_len or min(target.max_len, target.shape.max_positions))
        self.device = target.device
        self.ids = torch.zeros(self.context_len + PASS_WIDTHS[-1] + 1, dtype=torch.long, device=self.device)
        self.tokens: list[int] = []  # committed tokens, host copy of ids[:len(tokens)]
        self.breakdown = False  # phase timings (synchronizes the device around each phase)
        self.host_reads = 0  # device-to-host reads of the decode loop (one per step, see read)
        # Called with (engine, StepResult) after every committed step: calibration's recorder,
        # chat's live meter. The steps do not know about them.
        self.observers: list[Callable[[Engine, StepResult], None]] = []
        for m in self._models():
            m.allocate(self.context_len)
        if drafter is not None:
            drafter.ensure_capacity(self.context_len)
            drafter.link_slim(slim)

    # ------------------------------------------------------------------ models
    @property
    def slim(self) -> FastModel | None:
        return self._slim

    @slim.setter
    def slim(self, slim: FastModel | None) -> None:
        """Attach a slim verifier (calibration, chat and bench do it late): sized and compiled like the rest."""
        self._slim = slim
        if slim is not None:
            slim.allocate(self.context_len)
            if self._drafter is not None:
                self._drafter.link_slim(slim)
            if self.compiled and slim.compile():
                slim.warm_up()

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        """Attach a drafter (chat does it when a turn first needs one): its models are sized and compiled like the rest."""
        self._drafter = drafter
        if drafter is not None:
            drafter.ensure_capacity(self.context_len)
            drafter.link_slim(self._slim)
            if self.compiled and drafter.compile():
                drafter.warm_up()

    def _models(self) -> list[FastModel]:
        return [self.target] + ([self.slim] if self.slim is not None else [])

    def _roles(self) -> dict[str, FastModel]:
        return {"target": self.target, **({"slim": self.slim} if self.slim is not None else {})}

    def all_models(self) -> list[FastModel]:
        """Every FastModel the engine runs: target, slim verifier, the drafter's models."""
        return self._models() + (self.drafter.fast_models() if self.drafter is not None else [])

    def set_short_rows(self, rows) -> None:
        """Every model's short float32 passes take the products `rows` (a short_products.ShortRows) gives them."""
        for m in self._models():
            m.short_rows = rows
        if self.drafter is not None:
            self.drafter.set_short_rows(rows)

    def compile(self) -> bool:
        """torch.compile every model's pass (see FastModel.compile) and the drafter's step; False when
        none could be (`compiled_models` says which were)."""
        self.compiled = any([m.compile() for m in self._models()] + [self.drafter is not None and self.drafter.compile()])
        return self.compiled

    @property
    def compiled_models(self) -> tuple[str, ...]:
        """The names of the models whose passes run compiled (target, slim, draft), in that order."""
        draft = ("draft",) if self.drafter is not None and self.drafter.compiled else ()
        return tuple(m.name for m in self._models() if m.compiled) + draft

    def warm_up(self) -> float:
        """Compile now every graph a generation can meet (none compiles mid-generation); returns
        the seconds it took, 0.0 when nothing is compiled. Empties the caches."""
        seconds = sum(m.warm_up() for m in self._models())
        if self.drafter is not None:
            seconds += self.drafter.warm_up()
        self.reset()
        return seconds

    @property
    def supports_tree(self) -> bool:
        """Whether sd can draft token trees here (the drafter grows them, the target verifies them)."""
        return self.drafter is not None and self.drafter.supports_tree and self.target.supports_tree

    def warm_up_tree(self, shape: TreeShape) -> float:
        """Compile now the graphs trees of `shape` meet (the target's verify width, the head's level
        of `topk` rows); seconds taken, 0.0 when nothing is compiled. Empties the caches."""
        seconds = self.target.warm_up_tree(shape.size + 1)
        seconds += self.drafter.warm_up_tree(shape) if self.drafter is not None else 0.0
        self.reset()
        return seconds

    def clock(self) -> float:
        if self.breakdown and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def read(self, values: torch.Tensor) -> list[int]:
        """A step's device-to-host read (one per step in ar, sd and exact)."""
        self.host_reads += 1
        return values.tolist()

    def reset(self) -> None:
        self.tokens = []
        for m in self._models():
            m.reset()
        if self.drafter is not None:
            self.drafter.reset()

    # ------------------------------------------------------------------ public
    def generate(self, prompt_ids: list[int], config: GenerationConfig, on_emit=None, should_stop=None) -> Generation:
        """Generate after `prompt_ids` (the whole context: history included).

        on_emit(tokens, tiers) is called after every commit with the newly emitted tokens.
        should_stop() is asked after every step: True ends the generation there (finish_reason
        'cancelled'; a server's client went away), with every cache consistent as at any end.
        """
        steps = self.steps(prompt_ids, config, on_emit, should_stop)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(self, prompt_ids: list[int], config: GenerationConfig, on_emit=None, should_stop=None):
        """`generate` one step at a time: a generator that pauses after each committed step (and
        its should_stop) and returns the Generation. Between two steps the caller may run other
        generations on other caches (a server's slots, serve_slots.py) as long as it puts this
        one's back (the models' caches, `tokens`, `ids`, the drafter) before resuming it."""
        config.validate()
        if config.mode in ("sd", "exact", "viasd") and self.drafter is None:
            raise UsageError(f"mode '{config.mode}' needs a draft: pass --draft (a model or 'ngram')")
        if config.mode in ("exact", "viasd") and self.slim is None:
            raise UsageError(f"mode '{config.mode}' needs a slim verifier: run `viasd calibrate` to find its layer mask")
        if not prompt_ids:
            raise UsageError("the prompt is empty: give some text")
        if len(prompt_ids) >= self.context_len:
            raise ViasdError(
                f"the prompt has {len(prompt_ids)} tokens but the context is {self.context_len}: "
                "shorten the prompt or raise --max-context"
            )
        max_new = min(config.max_new_tokens, self.context_len - len(prompt_ids))
        if config.tree is not None and config.mode == "sd" and not self.supports_tree and config.grammar is None:
            raise UsageError("draft trees need an EAGLE-3 head draft and a target without sliding-window "
                             "attention: use --tree off")
        constraint = None  # the grammar's state for this generation (a one-line error when it is not valid)
        if config.grammar is not None:
            constraint = Constraint(config.grammar, self.tokenizer, self.target.embed.num_embeddings, self.eos, self.device)
        plan = plan_for(config.mode, config.thresholds, config.tree, constrained=constraint is not None)

        # Re-use cached positions shared with the previous call (multi-turn chat).
        keep = min(common_prefix(self.tokens, prompt_ids), len(prompt_ids) - 1)
        self._rollback(keep)
        self.tokens = list(prompt_ids)
        self.ids[: len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)

        stats = RunStats(mode=config.mode, prompt_tokens=len(prompt_ids))
        run = Run(config.sampling, Sampler(config.seed, device=self.device), stats,
                  plain_tier="ar" if plan.step is None else "full",
                  stop_below=config.min_confidence if config.adaptive else 0.0, thresholds=config.thresholds,
                  tree=config.tree, constraint=constraint)
        gen = Generation(list(prompt_ids), [], [], "", "length", stats)
        if max_new < config.max_new_tokens:
            gen.clipped_to = max_new
        t0 = self.clock()
        # prefill: every model that will run, up to the last prompt token (whose logits start the
        # decode); a slim verifier that runs later catches up in its first pass anyway.
        n = len(prompt_ids)
        stats.prefill_cached = self.target.seen  # prompt positions whose K/V the target kept
        for m in self._models():
            if m.seen < n - 1 and (m is not self.slim or plan.slim_runs):
                m.extend(self.ids, n - 1, 1)
        # What the target's prefill pass wrote, plus the last prompt token (the first step runs it).
        stats.prefill_processed = self.target.seen - stats.prefill_cached + 1
        if plan.step is not None:  # the drafter's own prompt positions: prefill, not the first step's draft
            self.drafter.prefill(self.ids, n)
        stats.time_prefill = self.clock() - t0
        policy = DraftPolicy(config.gamma, max(config.gamma, config.gamma_max), adaptive=config.adaptive,
                             floor=config.gamma_floor)
        try:
            while len(gen.tokens) < max_new:
                g = 0 if plan.step is None else min(policy.block_length(), max_new - len(gen.tokens) - 1)
                t_step = time.perf_counter()
                result = plan.step(self, run, g) if g > 0 else plain_step(self, run)
                self._commit(result)
                if constraint is not None:
                    constraint.commit(result.tokens)
                if stats.time_first_token is None and result.tokens:  # the step ended with its device read
                    stats.time_first_token = time.perf_counter() - t0
                # adapt: the step ended with its device read, so its wall time is real
                if "draft" in result.keep:  # a speculative step (its proposals may have been 0)
                    policy.record_spec(result.drafted, result.kept, len(result.tokens), time.perf_counter() - t_step)
                else:
                    policy.record_plain(len(result.tokens), time.perf_counter() - t_step)
                for observe in self.observers:
                    observe(self, result)
                if self._emit(gen, result.tokens, result.tiers, max_new, config, on_emit):
                    break
                if should_stop is not None and should_stop():
                    gen.finish_reason = "cancelled"
                    break
                yield result
        except KeyboardInterrupt:
            gen.finish_reason = "interrupted"
        # Caches stay consistent with the committed tokens, whatever happened above.
        self._rollback(len(self.tokens) - 1)
        for m in self.all_models():
            m.check_finite()  # a float16 overflow anywhere in the run (one read, not one per pass)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the one synchronization of the whole run, for its wall time
        stats.time_total = time.perf_counter() - t0
        stats.new_tokens = len(gen.tokens)
        gen.text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        if gen.finish_reason == "stop":
            gen.text = gen.text[: min(gen.text.find(s) for s in config.stop if s in gen.text)]
        return gen

    # ------------------------------------------------------------------ commit
    def _rollback(self, n: int) -> None:
        """Every cache keeps what depends on the first n tokens only."""
        for m in self._models():
            m.rollback(n)
        if self.drafter is not None:
            self.drafter.rollback(n)

    def _commit(self, result: StepResult) -> None:
        """The one commit of a step: its tokens (already in the buffer) join the host copy, and each
        model keeps n + keep[role] cached positions (n + k - 1 when absent from `keep`)."""
        n, k = result.position, len(result.tokens)
        self.tokens.extend(result.tokens)
        for role, m in self._roles().items():
            m.rollback(n + result.keep.get(role, k - 1))
        if "draft" in result.keep:
            self.drafter.rollback(n + result.keep["draft"])

    def _emit(self, gen: Generation, out: list[int], tiers: list[str], max_new: int, config: GenerationConfig, on_emit) -> bool:
        """Append to the generation; truncate at EOS, the budget or a stop string. True = finished."""
        done = False
        room = max_new - len(gen.tokens)
        if len(out) > room:
            out, tiers = out[:room], tiers[:room]
        for i, token in enumerate(out):
            if token in self.eos:
                out, tiers = out[: i + 1], tiers[: i + 1]
                gen.finish_reason = "eos"
                done = True
                break
        gen.tokens.extend(out)
        gen.tiers.extend(tiers)
        if config.stop:
            text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            if any(s in text for s in config.stop):
                gen.finish_reason = "stop"
                done = True
        if len(gen.tokens) >= max_new and not done:
            done = True
        # Keep the committed tokens equal to what was emitted (truncation may drop some).
        extra = len(self.tokens) - (len(gen.prompt_tokens) + len(gen.tokens))
        if extra > 0:
            del self.tokens[-extra:]
        if on_emit is not None and out:
            on_emit(out, tiers)
        return done
