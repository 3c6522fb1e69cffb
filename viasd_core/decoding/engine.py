"""The decoding loop: ar (plain), sd (two-tier, exact), exact (multi-tier, exact), viasd (three tiers).

One step of a speculative mode, in order:
  1. draft   - the drafter proposes `gamma` tokens into the token buffer
  2. route   - (exact, viasd) one slim-verifier pass over the block decides tiers / corrections
  3. verify  - one target pass over the block (viasd: only when a token is routed to `full`)
  4. accept  - the pure acceptance rule (greedy match or speculative sampling)
  5. commit  - write the emitted tokens on the device, read them ONCE on the host, roll every
               KV cache back to what it saw correctly
  6. adapt   - grow gamma after a fully accepted block, shrink it after an early rejection, and
               take plain steps while they measure faster than drafting (draft_policy.py)

The KV caches are static (see model.FastModel): rollback is a length reset. In `ar`, `sd` and
`exact` a step reads the device once (`_read`): the accepted count, how much of the draft was
kept and the emitted tokens, in one small tensor; everything before stays on the device.
`viasd` routes on the host (its tiers decide whether the target runs at all). Phase timings
need synchronizations: they are taken only when `breakdown` is on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from viasd_core.decoding.draft_policy import DraftPolicy
from viasd_core.errors import UsageError, ViasdError
from viasd_core.decoding.model import PASS_WIDTHS, FastModel
from viasd_core.decoding.router import OFF, BlockRecord, Thresholds, slim_confidence, unsure_to_full, walk_block
from viasd_core.decoding.sampling import Sampler, SamplingParams, greedy_accept, prefix_length, process_logits, speculative_sample
from viasd_core.decoding.stats import RunStats

MODES = ("ar", "sd", "exact", "viasd")


@dataclass
class GenerationConfig:
    mode: str = "sd"
    max_new_tokens: int = 128
    gamma: int = 5
    adaptive: bool = True
    gamma_max: int = 12
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    thresholds: Thresholds | None = None  # viasd mode
    # Adaptive only: a model draft stops before the token at which its own estimate that the whole
    # block is accepted (the product of its token probabilities) falls below this (0 = off).
    min_confidence: float = 0.15

    def validate(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"unknown mode '{self.mode}': use one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if self.gamma < 1:
            raise UsageError(f"gamma must be at least 1 (got {self.gamma}): pass --gamma 1 or more")
        if max(self.gamma, self.gamma_max if self.adaptive else self.gamma) + 1 > PASS_WIDTHS[-1]:
            raise UsageError(f"gamma can be at most {PASS_WIDTHS[-1] - 1} (a verify pass covers gamma + 1 tokens)")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (got {self.temperature}); 0 means greedy")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (got {self.top_k}); 0 turns it off")
        if not 0 <= self.min_confidence < 1:
            raise UsageError(f"--min-confidence must be in [0, 1) (got {self.min_confidence}); 0 turns the stop rule off")
        if self.mode == "viasd" and self.temperature > 0:
            raise UsageError("viasd mode is greedy-only (its gates are calibrated for greedy decoding); use --mode sd or exact to sample")
        if self.mode == "viasd" and self.thresholds is None:
            raise UsageError("viasd mode needs calibrated thresholds: run `viasd calibrate` first")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int]  # new tokens (EOS included when generation ended on it)
    tiers: list[str]  # per new token: ar / accept / slim / full / bonus
    text: str
    finish_reason: str  # eos, length, stop, interrupted, cancelled
    stats: RunStats = field(default_factory=RunStats)
    clipped_to: int | None = None  # max_new_tokens cut to what the context leaves after the prompt (None: kept)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """Batch-1 generation over a target, an optional drafter and an optional slim verifier.

    The engine keeps the committed tokens across calls, so a follow-up prompt that extends
    the previous conversation re-uses every cached position (chat). Every cache is allocated
    once, for `context_len` positions.
    """

    def __init__(self, target: FastModel, tokenizer, drafter=None, slim: FastModel | None = None,
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
        self.host_reads = 0  # device-to-host reads of the decode loop (one per step, see _read)
        for m in self._models():
            m.allocate(self.context_len)
        if drafter is not None:
            drafter.ensure_capacity(self.context_len)
        self._link()
        # Calibration: when a list, every greedy sd and viasd step appends a router.BlockRecord (the
        # slim verifier's gate values and teacher-forced labels) to it; sd runs the slim pass for it.
        self.recorder: list | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def slim(self) -> FastModel | None:
        return self._slim

    @slim.setter
    def slim(self, slim: FastModel | None) -> None:
        """Attach a slim verifier (calibration, chat and bench do it late): sized and compiled like the rest."""
        self._slim = slim
        if slim is not None:
            slim.allocate(self.context_len)
            self._link()
            if self.compiled and slim.compile():
                slim.warm_up()

    @property
    def drafter(self):
        return self._drafter

    @drafter.setter
    def drafter(self, drafter) -> None:
        """Attach a drafter (chat does it late): its model is sized and compiled like the rest."""
        self._drafter = drafter
        if drafter is not None:
            drafter.ensure_capacity(self.context_len)
            self._link()
            if self.compiled and getattr(drafter, "model", None) is not None and drafter.model.compile():
                drafter.model.warm_up(max_width=1)

    def _link(self) -> None:
        """A feature drafter reads the slim verifier's features where the target has not run."""
        link = getattr(self._drafter, "link_slim", None)
        if link is not None:
            link(self._slim)

    def _slim_runs(self, config: GenerationConfig) -> bool:
        """Whether a generation with `config` runs the slim verifier (calibration's recording does, in sd)."""
        active = config.thresholds is not None and config.thresholds.active
        return config.mode == "exact" or (config.mode == "viasd" and active) or self.recorder is not None

    def _models(self):
        out = [self.target]
        if self.slim is not None:
            out.append(self.slim)
        return out

    def all_models(self) -> list[FastModel]:
        """Every FastModel the engine runs: target, slim verifier, draft model."""
        draft = getattr(self.drafter, "model", None)
        return self._models() + ([draft] if draft is not None else [])

    def compile(self) -> bool:
        """torch.compile every model's pass (see FastModel.compile); False when none could be
        (`compiled_models` says which were)."""
        self.compiled = any([m.compile() for m in self.all_models()])
        return self.compiled

    @property
    def compiled_models(self) -> tuple[str, ...]:
        """The names of the models whose passes run compiled (target, slim, draft), in that order."""
        return tuple(m.name for m in self.all_models() if m.compiled)

    def warm_up(self) -> float:
        """Compile now every graph a generation can meet (none compiles mid-generation); returns
        the seconds it took, 0.0 when nothing is compiled. Empties the caches."""
        seconds = sum(m.warm_up() for m in self._models())
        draft = getattr(self.drafter, "model", None)
        if draft is not None:
            seconds += draft.warm_up(max_width=1)  # a draft runs 1-token steps and 2-token catch-ups
        self.reset()
        return seconds

    def _clock(self) -> float:
        if self.breakdown and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _read(self, values: torch.Tensor) -> list[int]:
        """The step's one device-to-host read."""
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

        # Re-use cached positions shared with the previous call (multi-turn chat).
        keep = common_prefix(self.tokens, prompt_ids)
        keep = min(keep, len(prompt_ids) - 1)
        for m in self._models():
            m.rollback(keep)
        if self.drafter is not None:
            self.drafter.rollback(keep)
        self.tokens = list(prompt_ids)
        self.ids[: len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)

        stats = RunStats(mode=config.mode, prompt_tokens=len(prompt_ids))
        sampler = Sampler(config.seed, device=self.device)
        gen = Generation(list(prompt_ids), [], [], "", "length", stats)
        if max_new < config.max_new_tokens:
            gen.clipped_to = max_new
        t0 = self._clock()
        # Prefill every model that will run up to the last prompt token (whose logits start the
        # decode). A slim verifier the mode never runs (ar, sd, viasd with its tiers off) is not
        # prefilled; one that runs later catches up in its first pass anyway.
        n = len(prompt_ids)
        stats.prefill_cached = self.target.seen  # prompt positions whose K/V the target kept
        for m in self._models():
            if m.seen < n - 1 and (m is not self.slim or self._slim_runs(config)):
                m.extend(self.ids, n - 1, 1)
        # What the target's prefill pass wrote, plus the last prompt token (the first step runs it).
        stats.prefill_processed = self.target.seen - stats.prefill_cached + 1
        stats.time_prefill = self._clock() - t0
        policy = DraftPolicy(config.gamma, max(config.gamma, config.gamma_max), adaptive=config.adaptive)
        try:
            while len(gen.tokens) < max_new:
                left = max_new - len(gen.tokens)
                g = 0 if config.mode == "ar" else min(policy.block_length(), left - 1)
                t_step = time.perf_counter()
                if g == 0:
                    out, tiers = self._step_ar(config, sampler, stats)
                    policy.record_plain(len(out), time.perf_counter() - t_step)
                else:
                    out, tiers, n_drafted, n_kept = self._step_spec(config, g, sampler, stats)
                    # 6. adapt: the step ended with its device read, so its wall time is real
                    if n_drafted:
                        policy.record_spec(n_drafted, n_kept, len(out), time.perf_counter() - t_step)
                    else:
                        policy.record_plain(len(out), time.perf_counter() - t_step)
                if self._emit(gen, out, tiers, max_new, config, on_emit):
                    break
                if should_stop is not None and should_stop():
                    gen.finish_reason = "cancelled"
                    break
        except KeyboardInterrupt:
            gen.finish_reason = "interrupted"
        # Caches stay consistent with the committed tokens, whatever happened above.
        n = len(self.tokens)
        for m in self._models():
            m.rollback(n - 1)
        if self.drafter is not None:
            self.drafter.rollback(n - 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the one synchronization of the whole run, for its wall time
        stats.time_total = time.perf_counter() - t0
        stats.new_tokens = len(gen.tokens)
        gen.text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        if gen.finish_reason == "stop":
            gen.text = gen.text[: min(gen.text.find(s) for s in config.stop if s in gen.text)]
        return gen

    # ------------------------------------------------------------------ steps
    def _step_ar(self, config: GenerationConfig, sampler: Sampler, stats: RunStats):
        n = len(self.tokens)
        t = self._clock()
        logits = self.target.extend(self.ids, n, 1)
        if config.sampling.greedy:
            token_t = logits.argmax(-1)  # [1]
        else:
            token_t = sampler.categorical(process_logits(logits, config.sampling))
        self.ids[n : n + 1] = token_t
        token = self._read(token_t)[0]
        stats.time_verify += self._clock() - t
        stats.target_passes += 1
        stats.steps += 1
        stats.accepted_lengths.append(1)
        stats.tier_counts["full"] += 1
        self._commit(n, [token], written=True)
        return [token], ["full" if config.mode != "ar" else "ar"]

    def _step_spec(self, config: GenerationConfig, g: int, sampler: Sampler, stats: RunStats):
        n = len(self.tokens)
        params = config.sampling
        # 1. draft
        t = self._clock()
        proposal = self.drafter.propose(self.ids, n, g, params, sampler, host_tokens=self.tokens,
                                        stop_below=config.min_confidence if config.adaptive else 0.0)
        self.host_reads += proposal.reads
        g = proposal.tokens.shape[0]
        stats.time_draft += self._clock() - t
        if g == 0:  # nothing to propose (prompt lookup found no match): a plain step
            out, tiers = self._step_ar(config, sampler, stats)
            return out, tiers, 0, 0
        stats.draft_tokens += g
        stats.steps += 1

        if config.mode == "viasd" and config.thresholds.active:
            drafted = self._read(proposal.tokens)  # viasd routes on the host
            out, tiers, fed = self._route_viasd(n, g, drafted, config.thresholds, stats)
            keep = {m: common_prefix(out, fed[id(m)]) for m in self._models() if id(m) in fed}
            keep_draft = common_prefix(out, drafted)
            self._commit(n, out, keep)
            kept = keep_draft
        else:
            out, tiers, kept, keep_draft = self._verify_block(config, n, g, proposal, sampler, stats)
        stats.accepted_lengths.append(len(out))
        stats.record_block(g, kept)
        self.drafter.rollback(n + keep_draft)
        return out, tiers, g, kept

    def _verify_block(self, config: GenerationConfig, n: int, g: int, proposal, sampler: Sampler, stats: RunStats):
        """sd and exact: steps 2-5 with the device read once. Returns (out, tiers, kept, kept_draft)."""
        params = config.sampling
        drafted_t = self.ids[n : n + g].clone()  # [g] what the draft proposed (and its cache holds)
        draft_probs = proposal.probs
        if config.mode == "exact":
            # 2. route: the slim verifier refines the block (exact: the target still checks it).
            # Its greedy choice at every position replaces the draft's: equal on the prefix it
            # agrees with, its own token at the first disagreement, a valid proposal after it.
            t = self._clock()
            slim_argmax = self.slim.extend(self.ids, n + g, g + 1).argmax(-1)  # [g + 1]
            stats.time_slim += self._clock() - t
            stats.slim_passes += 1
            self.ids[n : n + g] = slim_argmax[:g]
            draft_probs = None  # every refined token is the slim's deterministic choice
        # 3. verify: one target pass over the pending token(s) and the block
        t = self._clock()
        target_logits = self.target.extend(self.ids, n + g, g + 1)  # [g + 1, V]
        if self.recorder is not None and config.mode == "sd" and params.greedy:
            # Calibration only: the slim runs over the drafted block, as viasd's slim pass would, so
            # before the accepted tokens overwrite the draft's in the buffer.
            self._record(n, g, drafted_t.tolist(), target_logits.argmax(-1).tolist(), {})
        # 4. accept
        block_t = self.ids[n : n + g]
        if params.greedy:
            emitted, n_acc = greedy_accept(block_t, target_logits.argmax(-1))
        else:
            target_probs = process_logits(target_logits, params)
            if draft_probs is None:
                draft_probs = torch.nn.functional.one_hot(block_t, target_probs.shape[-1]).float()
            emitted, n_acc = speculative_sample(block_t, draft_probs, target_probs, sampler.uniform(g, self.device), sampler)
        # 5. commit: tokens on the device first, then the one read of the step
        self.ids[n : n + g + 1] = emitted
        kept_draft_t = torch.minimum(prefix_length(emitted[:g] == drafted_t), n_acc + 1)
        vals = self._read(torch.cat([n_acc.view(1), kept_draft_t.view(1), emitted]))
        n_acc, kept_draft, out = vals[0], vals[1], vals[2 : vals[0] + 3]
        stats.time_verify += self._clock() - t
        stats.target_passes += 1
        stats.tier_counts["full"] += len(out) - n_acc - (1 if n_acc == g else 0)
        stats.tier_counts["accept"] += n_acc
        stats.tier_counts["bonus"] += 1 if n_acc == g else 0
        tiers = ["accept"] * n_acc + ["bonus" if n_acc == g else "full"]
        keep = {self.target: n_acc}
        if config.mode == "exact":
            keep[self.slim] = kept_draft  # the slim ran over the draft's tokens
        self._commit(n, out, keep, written=True)
        return out, tiers, n_acc, kept_draft

    def _record(self, n: int, g: int, block: list[int], target_argmax: list[int], fed: dict, route=None) -> None:
        """One BlockRecord for calibration: the slim's gate and argmax against the target's choices.

        `route`: the slim pass's RouteResult when the step already ran it (viasd); else it runs
        here. The gate is route_block's, the one the engine routes with.
        """
        if route is None:
            from viasd_kernels import route_block

            slim_logits = self.slim.extend(self.ids, n + g, g + 1)  # [g + 1, V]
            fed[id(self.slim)] = block
            route = route_block(slim_logits, self.ids[n : n + g], 0.0, OFF, OFF)  # the gate only
        self.recorder.append(BlockRecord.from_choices(route.gate.tolist(), block, route.argmax.tolist(), target_argmax,
                                                      slim_confidence(route, g).tolist()))

    def _route_viasd(self, n: int, g: int, block: list[int], th: Thresholds, stats: RunStats):
        """Three tiers (docs/algorithm.md section 2): accept / slim / full, walked by router.walk_block."""
        from viasd_kernels import route_block

        # 2. route: one slim pass over the block gives the gate and tier of every position
        t = self._clock()
        slim_logits = self.slim.extend(self.ids, n + g, g + 1)  # [g + 1, V]
        route = route_block(slim_logits, self.ids[n : n + g], 0.0, th.accept, th.slim)
        tiers_code = unsure_to_full(route.tiers, slim_confidence(route, g), th).tolist()
        slim_argmax = route.argmax.tolist()
        stats.time_slim += self._clock() - t
        stats.slim_passes += 1
        fed = {id(self.slim): block}
        target_argmax: list[int] = []

        def verify(counted: bool) -> list[int]:
            if not target_argmax:  # 3. verify: one target pass over the block, at most once a step
                t = self._clock()
                target_argmax.extend(self.target.extend(self.ids, n + g, g + 1).argmax(-1).tolist())
                fed[id(self.target)] = block
                if counted:
                    stats.time_verify += self._clock() - t
                    stats.target_passes += 1
            return target_argmax

        tiers = walk_block(tiers_code, [slim_argmax[j] == block[j] for j in range(g)], lambda j: verify(True)[j] == block[j])
        source = {"accept": block, "slim": slim_argmax, "full": target_argmax, "bonus": target_argmax}
        out = [source[name][j] for j, name in enumerate(tiers)]
        if self.recorder is not None:  # teacher-forced labels; a pass the walk did not need is not counted
            self._record(n, g, block, verify(False), fed, route)
        for name in tiers:
            stats.tier_counts[name] += 1
        return out, tiers, fed

    # ------------------------------------------------------------------ commit
    def _commit(self, n: int, out: list[int], keep: dict | None = None, written: bool = False) -> None:
        """Commit `out` at positions [n, n + len(out)); model m keeps n + keep[m] cached positions.

        A model absent from `keep` keeps n + len(out) - 1: either it did not run this step (it has
        seen <= n already; rollback only ever shortens) or it ran over exactly the kept tokens.
        `written`: the tokens are already in the device buffer (no host-to-device copy).
        """
        k = len(out)
        keep = keep or {}
        if not written:
            self.ids[n : n + k] = torch.tensor(out, dtype=torch.long, device=self.device)
        self.tokens.extend(out)
        for m in self._models():
            m.rollback(n + keep.get(m, k - 1))

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
