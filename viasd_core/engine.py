"""The decoding loop: ar (plain), sd (two-tier, exact), exact (multi-tier, exact), viasd (three tiers).

One step of a speculative mode, in order:
  1. draft   - the drafter proposes `gamma` tokens into the token buffer
  2. route   - (exact, viasd) one slim-verifier pass over the block decides tiers / corrections
  3. verify  - one target pass over the block (viasd: only when a token is routed to `full`)
  4. accept  - the pure acceptance rule (greedy match or speculative sampling)
  5. commit  - copy the emitted tokens, roll every KV cache back to what it saw correctly
  6. adapt   - grow gamma after a fully accepted block, shrink it after an early rejection

The KV caches are static (see model.FastModel): rollback is a length reset.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .errors import UsageError, ViasdError
from .model import FastModel
from .router import OFF, BlockRecord, Thresholds, walk_block
from .sampling import Sampler, SamplingParams, greedy_accept, process_logits, speculative_sample
from .stats import RunStats

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

    def validate(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"unknown mode '{self.mode}': use one of {', '.join(MODES)}")
        if self.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if self.gamma < 1:
            raise UsageError(f"gamma must be at least 1 (got {self.gamma}): pass --gamma 1 or more")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (got {self.temperature}); 0 means greedy")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (got {self.top_k}); 0 turns it off")
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
    finish_reason: str  # eos, length, stop, interrupted
    stats: RunStats = field(default_factory=RunStats)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """Batch-1 generation over a target, an optional drafter and an optional slim verifier.

    The engine keeps the committed tokens across calls, so a follow-up prompt that extends
    the previous conversation re-uses every cached position (chat).
    """

    def __init__(self, target: FastModel, tokenizer, drafter=None, slim: FastModel | None = None,
                 eos_token_ids: set[int] | None = None, context_len: int | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.slim = slim
        self.eos = set(eos_token_ids or ())
        self.context_len = int(context_len or target.shape.max_positions)
        self.device = target.device
        self.ids = torch.zeros(0, dtype=torch.long, device=self.device)
        self.tokens: list[int] = []  # committed tokens, host copy of ids[:len(tokens)]
        self._sync = self.device.type == "cuda"
        # Calibration: when a list, every sd step also runs the slim verifier over the block and
        # appends a router.BlockRecord (gate values and teacher-forced labels) to it.
        self.recorder: list | None = None

    # ------------------------------------------------------------------ helpers
    def _models(self):
        out = [self.target]
        if self.slim is not None:
            out.append(self.slim)
        return out

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.ids.shape[0]:
            size = min(self.context_len + 16, max(needed, 2 * self.ids.shape[0], 256))
            size = max(size, needed)
            ids = torch.zeros(size, dtype=torch.long, device=self.device)
            ids[: len(self.tokens)] = self.ids[: len(self.tokens)]
            self.ids = ids
        for m in self._models():
            if needed > m.max_len:
                m.allocate(self.ids.shape[0])
        if self.drafter is not None:
            self.drafter.ensure_capacity(self.ids.shape[0])

    def _clock(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset(self) -> None:
        self.tokens = []
        for m in self._models():
            m.reset()
        if self.drafter is not None:
            self.drafter.reset()

    # ------------------------------------------------------------------ public
    def generate(self, prompt_ids: list[int], config: GenerationConfig, on_emit=None) -> Generation:
        """Generate after `prompt_ids` (the whole context: history included).

        on_emit(tokens, tiers) is called after every commit with the newly emitted tokens.
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
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {self.context_len}: shorten the prompt"
            )
        max_new = min(config.max_new_tokens, self.context_len - len(prompt_ids))
        gamma_cap = max(config.gamma, config.gamma_max if config.adaptive else config.gamma)
        self._ensure_capacity(len(prompt_ids) + max_new + gamma_cap + 2)

        # Re-use cached positions shared with the previous call (multi-turn chat).
        keep = _common_prefix(self.tokens, prompt_ids)
        keep = min(keep, len(prompt_ids) - 1)
        for m in self._models():
            m.rollback(keep)
        if self.drafter is not None:
            self.drafter.rollback(keep)
        self.tokens = list(prompt_ids)
        self.ids[: len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)

        stats = RunStats(mode=config.mode, prompt_tokens=len(prompt_ids))
        sampler = Sampler(config.seed, device="cpu")
        gen = Generation(list(prompt_ids), [], [], "", "length", stats)
        t0 = self._clock()
        # Prefill every model up to the last prompt token (whose logits start the decode).
        n = len(prompt_ids)
        for m in self._models():
            if m.seen < n - 1:
                m.extend(self.ids, n - 1, 1)
        stats.time_prefill = self._clock() - t0
        gamma = config.gamma
        try:
            while len(gen.tokens) < max_new:
                left = max_new - len(gen.tokens)
                if config.mode == "ar" or left == 1:
                    out, tiers = self._step_ar(config, sampler, stats)
                else:
                    g = min(gamma, left - 1)
                    out, tiers, n_drafted, n_kept = self._step_spec(config, g, sampler, stats)
                    if n_drafted and config.adaptive:  # 6. adapt
                        if n_kept == n_drafted:
                            gamma = min(gamma + 1, config.gamma_max)
                        elif n_kept < n_drafted // 2:
                            gamma = max(gamma - 1, 1)
                if self._emit(gen, out, tiers, max_new, config, on_emit):
                    break
        except KeyboardInterrupt:
            gen.finish_reason = "interrupted"
        # Caches stay consistent with the committed tokens, whatever happened above.
        n = len(self.tokens)
        for m in self._models():
            m.rollback(n - 1)
        if self.drafter is not None:
            self.drafter.rollback(n - 1)
        stats.time_total = self._clock() - t0
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
            token = int(logits[0].argmax())
        else:
            token = int(sampler.categorical(process_logits(logits, config.sampling))[0])
        stats.time_verify += self._clock() - t
        stats.target_passes += 1
        stats.steps += 1
        stats.accepted_lengths.append(1)
        stats.tier_counts["full"] += 1
        self._commit([token], [self.target])
        return [token], ["full" if config.mode != "ar" else "ar"]

    def _step_spec(self, config: GenerationConfig, g: int, sampler: Sampler, stats: RunStats):
        n = len(self.tokens)
        params = config.sampling
        # 1. draft
        t = self._clock()
        proposal = self.drafter.propose(self.ids, n, g, params, sampler, host_tokens=self.tokens)
        g = proposal.tokens.shape[0]
        stats.time_draft += self._clock() - t
        if g == 0:  # nothing to propose (prompt lookup found no match): a plain step
            out, tiers = self._step_ar(config, sampler, stats)
            return out, tiers, 0, 0
        stats.draft_tokens += g
        stats.steps += 1
        drafted = proposal.tokens.tolist()  # the one host sync of the draft phase
        block = drafted

        if config.mode == "viasd" and config.thresholds.active:
            out, tiers, fed = self._route_viasd(n, g, block, config.thresholds, stats)
        else:
            fed = {id(self.target): block}
            draft_probs = proposal.probs
            if config.mode == "exact":
                # 2. route: the slim verifier refines the block (exact: the target still checks it)
                t = self._clock()
                slim_argmax = self.slim.extend(self.ids, n + g, g + 1).argmax(-1).tolist()
                stats.time_slim += self._clock() - t
                stats.slim_passes += 1
                fed[id(self.slim)] = block
                m = _common_prefix(block, slim_argmax[:g])
                refined = slim_argmax[: m + 1]  # draft tokens the slim agrees with, then its own token
                self.ids[n : n + m + 1] = torch.tensor(refined, dtype=torch.long, device=self.device)
                block, g = refined, m + 1
                draft_probs = None  # every refined token is the slim's deterministic choice
                fed[id(self.target)] = block
            # 3. verify: one target pass over the pending token(s) and the block
            t = self._clock()
            target_logits = self.target.extend(self.ids, n + g, g + 1)  # [g + 1, V]
            # 4. accept
            block_t = self.ids[n : n + g]
            if params.greedy:
                emitted, n_acc = greedy_accept(block_t, target_logits.argmax(-1))
                vals = torch.cat([n_acc[None], emitted]).tolist()
                n_acc, out = vals[0], vals[1 : vals[0] + 2]
            else:
                target_probs = process_logits(target_logits, params)
                if draft_probs is None:
                    draft_probs = torch.nn.functional.one_hot(block_t, target_probs.shape[-1]).float()
                emitted, n_acc = speculative_sample(block_t, draft_probs, target_probs, sampler.uniform(g, self.device), sampler)
                out = emitted.tolist()
            stats.time_verify += self._clock() - t
            stats.target_passes += 1
            if self.recorder is not None and config.mode == "sd" and params.greedy:
                self._record(n, g, block, target_logits.argmax(-1).tolist(), fed)
            stats.tier_counts["full"] += len(out) - n_acc - (1 if n_acc == g else 0)
            stats.tier_counts["accept"] += n_acc
            stats.tier_counts["bonus"] += 1 if n_acc == g else 0
            tiers = ["accept"] * n_acc + ["bonus" if n_acc == g else "full"]
        stats.accepted_lengths.append(len(out))
        kept = _common_prefix(out, block)
        stats.record_block(g, kept)
        # 5. commit
        self._commit(out, self._models(), fed, n)
        if self.drafter is not None:
            self.drafter.rollback(n + _common_prefix(out, drafted))
        return out, tiers, g, kept

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
        self.recorder.append(BlockRecord.from_choices(route.gate.tolist(), block, route.argmax.tolist(), target_argmax))

    def _route_viasd(self, n: int, g: int, block: list[int], th: Thresholds, stats: RunStats):
        """Three tiers (ALGORITHM.md section 2): accept / slim / full, walked by router.walk_block."""
        from viasd_kernels import route_block

        # 2. route: one slim pass over the block gives the gate and tier of every position
        t = self._clock()
        slim_logits = self.slim.extend(self.ids, n + g, g + 1)  # [g + 1, V]
        route = route_block(slim_logits, self.ids[n : n + g], 0.0, th.accept, th.slim)
        tiers_code = route.tiers.tolist()
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
    def _commit(self, out: list[int], models, fed: dict | None = None, n: int | None = None) -> None:
        n = len(self.tokens) if n is None else n
        k = len(out)
        self.ids[n : n + k] = torch.tensor(out, dtype=torch.long, device=self.device)
        self.tokens.extend(out)
        for m in models:
            seen_block = (fed or {}).get(id(m))
            # A model that ran over the block keeps the positions whose tokens were kept; one that
            # did not run this step has seen <= n already (rollback only ever shortens).
            m.rollback(n + _common_prefix(out, seen_block) if seen_block is not None else n + k - 1)

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
