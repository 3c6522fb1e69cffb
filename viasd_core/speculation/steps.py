"""One step of each decoding mode, each read top to bottom: draft, route, verify, accept, commit.

    plain_step         ar; also any step the draft policy makes plain or the draft leaves empty
    speculative_step   sd: draft -> verify (one target pass over the block) -> accept
    tree_step          sd with a token tree: draft a tree -> verify it in one pass -> accept the
                       longest path the target agrees with (tree.py)
    refined_step       exact: draft -> route (the slim refines the block) -> verify -> accept
    tiered_step        viasd: draft -> route (one slim pass gives every position's tier) ->
                       verify only from the first 'full' position -> walk the tiers

The mode is chosen once per generation (`plan_for`); no step asks which mode it serves.
A step writes the tokens it emits into the engine's token buffer, ids[n : n + k], and returns a
`StepResult`; the engine commits it (host copy of the tokens, every cache rolled back to what it
saw correctly: `StepResult.keep`), lets the draft policy learn from it and hands it to its
observers (calibration records blocks from it; chat counts acceptance), none of which the step
knows about.

Plain, speculative and refined steps read the device once (`Engine.read`): the accepted count,
how much of the draft stays valid and the emitted tokens, in one small tensor. The tiered step
reads the draft and the slim's tiers on the host, since they decide whether the target runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from viasd_kernels import RouteResult, route_block

from viasd_core.speculation.drafters import Drafter, Proposal
from viasd_core.speculation.grammar import Constraint
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.router import Thresholds, block_tiers, walk_block
from viasd_core.speculation.sampling import (Sampler, SamplingParams, chain_presence, greedy_accept, penalize, prefix_length,
                                          presence, presence_rows, process_logits, speculative_sample)
from viasd_core.speculation.stats import NO_DRAFT, RunStats
from viasd_core.speculation.tree import TreeShape, accept_path


class Decoder(Protocol):
    """What a step reads and writes of the engine (decoding.engine.Engine is the one implementation)."""

    target: FastModel
    slim: FastModel | None
    drafter: Drafter | None
    ids: torch.Tensor  # [context + widest pass] int64, the token buffer
    tokens: list[int]  # the committed tokens, host copy of ids[:len(tokens)]
    device: torch.device
    host_reads: int

    def clock(self) -> float: ...

    def read(self, values: torch.Tensor) -> list[int]: ...


@dataclass
class StepResult:
    """What one step did. Roles in `keep`: 'target', 'slim', 'draft'."""

    position: int  # n: the position of the first emitted token
    tokens: list[int]  # [k] emitted tokens, already written to ids[n : n + k]
    tiers: list[str]  # [k] who decided each: ar / accept / slim / full / bonus
    drafted: int = 0  # tokens the draft proposed (0: a plain step)
    kept: int = 0  # drafted tokens that were emitted as drafted (acceptance statistics)
    # Per role, how many of the positions n, n + 1, ... its cache keeps. A model absent here keeps
    # k - 1: it either did not run this step or ran over exactly the emitted tokens. The draft is
    # rolled back only after a step that drafted ('draft' present, even with 0 proposals).
    keep: dict[str, int] = field(default_factory=dict)
    draft_tokens: torch.Tensor | None = None  # [g] what the draft proposed (the buffer now holds `tokens`)
    target_argmax: list[int] | None = None  # [g + 1] the target's choices over the drafted block, if it ran over it
    route: RouteResult | None = None  # the slim pass over the drafted block, if one ran


@dataclass
class Run:
    """What every step of one generation shares."""

    params: SamplingParams
    sampler: Sampler
    stats: RunStats
    plain_tier: str  # the tier of a plain step's token: 'ar' in ar mode, else 'full'
    stop_below: float  # the draft's confidence stop rule (0 = off)
    thresholds: Thresholds | None  # tiered steps only
    tree: TreeShape | None = None  # tree steps only
    constraint: Constraint | None = None  # a grammar masks the target's (and the draft's) logits (grammar.py)


Step = Callable[[Decoder, Run, int], StepResult]


def penalized(eng: Decoder, run: Run, logits: torch.Tensor, block: torch.Tensor | None = None,
              sees: torch.Tensor | None = None) -> torch.Tensor:
    """The repetition penalty on a pass's logits (unchanged when it is off): each row over its own
    history, the committed context ids[:n] plus what the row saw of the drafted block. block None:
    one row after the context; `block` [g] alone: a chain, row j saw block[:j] (rows g + 1, the last
    the bonus); with `sees` [R, g] bool: row r saw the block tokens it marks (a tree's ancestors)."""
    if not run.params.penalized:
        return logits
    seen = presence(eng.ids[: len(eng.tokens)], logits.shape[-1])
    if block is not None:
        seen = chain_presence(seen, block) if sees is None else presence_rows(seen, block, sees)
    return penalize(logits, seen, run.params.repetition_penalty)


@dataclass(frozen=True)
class Plan:
    """The step a generation runs, chosen once from its mode."""

    step: Step | None  # None: every step is plain
    slim_runs: bool  # whether the slim verifier runs (it is prefilled only then)


def plan_for(mode: str, thresholds: Thresholds | None, tree: TreeShape | None = None, constrained: bool = False) -> Plan:
    if mode == "ar":
        return Plan(None, slim_runs=False)
    if constrained:  # every speculative mode drafts chains and verifies them with the target alone
        return Plan(constrained_step, slim_runs=False)
    if mode == "exact":
        return Plan(refined_step, slim_runs=True)
    if mode == "viasd" and thresholds is not None and thresholds.active:
        return Plan(tiered_step, slim_runs=True)
    if tree is not None and not tree.is_chain:
        return Plan(tree_step, slim_runs=False)
    return Plan(speculative_step, slim_runs=False)  # sd, and viasd with both tiers off


# ---------------------------------------------------------------------- plain
def plain_step(eng: Decoder, run: Run, g: int = 0) -> StepResult:
    """One target pass over the pending token; its next token (greedy or sampled)."""
    n = len(eng.tokens)
    t = eng.clock()
    target_logits = penalized(eng, run, eng.target.extend(eng.ids, n, 1))  # [1, V]
    if run.constraint is not None:
        target_logits = run.constraint.mask(target_logits, run.constraint.allowed(1))
    if run.params.greedy:
        token_t = target_logits.argmax(-1)  # [1]
    else:
        token_t = run.sampler.categorical(process_logits(target_logits, run.params))
    eng.ids[n : n + 1] = token_t
    token = eng.read(token_t)[0]
    stats = run.stats
    stats.time_verify += eng.clock() - t
    stats.target_passes += 1
    stats.steps += 1
    stats.accepted_lengths.append(1)
    stats.tier_counts["full"] += 1
    return StepResult(n, [token], [run.plain_tier])


# ---------------------------------------------------------------------- sd and exact
def _draft(eng: Decoder, run: Run, g: int) -> Proposal | None:
    """1. draft: up to g tokens into ids[n : n + g]; None when the draft proposes nothing."""
    n = len(eng.tokens)
    t = eng.clock()
    proposal = eng.drafter.propose(eng.ids, n, g, run.params, run.sampler, host_tokens=eng.tokens,
                                   stop_below=run.stop_below)
    eng.host_reads += proposal.reads
    run.stats.time_draft += eng.clock() - t
    run.stats.record_source((proposal.source or eng.drafter.name) if proposal.tokens.shape[0] else NO_DRAFT)
    return proposal if proposal.tokens.shape[0] else None


def speculative_step(eng: Decoder, run: Run, g: int) -> StepResult:
    """sd: the target verifies the draft's block in one pass; exact in greedy and sampling."""
    proposal = _draft(eng, run, g)
    if proposal is None:
        return plain_step(eng, run)
    return _verify_and_accept(eng, run, proposal, proposal.tokens.clone(), proposal.probs, refined=False)


def refined_step(eng: Decoder, run: Run, g: int) -> StepResult:
    """exact: the slim verifier refines the draft's block before the target verifies it.

    Its greedy choice at every position replaces the draft's: equal on the prefix it agrees with,
    its own token at the first disagreement, a valid proposal after it. Still exact: the target
    checks every refined token (one-hot proposals under sampling).
    """
    proposal = _draft(eng, run, g)
    if proposal is None:
        return plain_step(eng, run)
    n, g = len(eng.tokens), proposal.tokens.shape[0]
    draft_tokens = proposal.tokens.clone()  # [g] what the draft proposed (and its cache holds)
    # 2. route: one slim pass over the drafted block
    t = eng.clock()
    slim_argmax = penalized(eng, run, eng.slim.extend(eng.ids, n + g, g + 1), eng.ids[n : n + g]).argmax(-1)  # [g + 1]
    run.stats.time_slim += eng.clock() - t
    run.stats.slim_passes += 1
    eng.ids[n : n + g] = slim_argmax[:g]
    return _verify_and_accept(eng, run, proposal, draft_tokens, None, refined=True)


def _verify_and_accept(eng: Decoder, run: Run, proposal: Proposal, draft_tokens: torch.Tensor, draft_probs,
                       refined: bool, allowed: torch.Tensor | None = None) -> StepResult:
    """Steps 3-5 of sd and exact over the block in ids[n : n + g], with the device read once.
    `allowed` [g + 1, V] bool: what a grammar allows at each row (constrained_step)."""
    n, g = len(eng.tokens), draft_tokens.shape[0]
    stats, params = run.stats, run.params
    limit = proposal.limit  # [] int64 or None: the proposals' count, when decided on the device
    # 3. verify: one target pass over the pending token and the block
    t = eng.clock()
    # row j penalized over the context and the proposals before j (refined ones in exact)
    target_logits = penalized(eng, run, eng.target.extend(eng.ids, n + g, g + 1), eng.ids[n : n + g])  # [g + 1, V]
    if allowed is not None:
        target_logits = run.constraint.mask(target_logits, allowed)
    target_argmax = target_logits.argmax(-1)  # [g + 1]
    # 4. accept
    block = eng.ids[n : n + g]  # [g] the proposals (refined ones in exact)
    if params.greedy:
        emitted, n_acc = greedy_accept(block, target_argmax, limit)
    else:
        target_probs = process_logits(target_logits, params)
        if draft_probs is None:  # deterministic proposals: one-hot distributions
            draft_probs = torch.nn.functional.one_hot(block, target_probs.shape[-1]).float()
        emitted, n_acc = speculative_sample(block, draft_probs, target_probs, run.sampler.uniform(g, eng.device),
                                            run.sampler, limit)
    # 5. commit: the tokens on the device first, then the step's one read (which also carries the
    # proposals' count and the target's choices over the block, for observers)
    eng.ids[n : n + g + 1] = emitted
    draft_valid_t = torch.minimum(prefix_length(emitted[:g] == draft_tokens), n_acc + 1)
    counts = [n_acc.view(1), draft_valid_t.view(1)] + ([limit.view(1)] if limit is not None else [])
    vals = eng.read(torch.cat(counts + [emitted, target_argmax]))
    n_acc, draft_valid = vals[0], vals[1]
    proposals = vals[2] if limit is not None else g  # without a device-side cut, all g are proposals
    vals = vals[len(counts):]
    tokens, target_choices = vals[: n_acc + 1], vals[g + 1 :]
    stats.time_verify += eng.clock() - t
    tiers = _count_verified(stats, proposals, n_acc, len(tokens))
    keep = {"target": n_acc, "draft": draft_valid}
    if refined:
        keep["slim"] = draft_valid  # the slim ran over the draft's tokens
    return StepResult(n, tokens, tiers, drafted=proposals, kept=n_acc, keep=keep, draft_tokens=draft_tokens,
                      target_argmax=target_choices)


def constrained_step(eng: Decoder, run: Run, g: int) -> StepResult:
    """sd under a grammar (docs/algorithm.md, "Constrained decoding"): a chain draft proposes from
    logits masked by the grammar's state after its own tokens so far; the block ends before the first
    token the grammar rejects (a prompt-lookup proposal may hold one); the target's row at every
    block position is masked by the state after the block's prefix before it, so greedy sd emits
    exactly constrained ar's tokens and speculative sampling keeps constrained ar's distribution."""
    c, n = run.constraint, len(eng.tokens)
    t = eng.clock()
    with c.drafting(eng.drafter, eng.ids, n):
        proposal = eng.drafter.propose(eng.ids, n, g, run.params, run.sampler, host_tokens=eng.tokens)
    eng.host_reads += proposal.reads + c.reads
    c.reads = 0
    valid = c.follow(eng.read(proposal.tokens))
    run.stats.time_draft += eng.clock() - t
    if valid == 0:
        eng.drafter.rollback(n)  # it may have run its own drafted tokens
        return plain_step(eng, run)
    probs = None if proposal.probs is None else proposal.probs[:valid]
    cut = Proposal(tokens=proposal.tokens[:valid], probs=probs)
    return _verify_and_accept(eng, run, cut, cut.tokens.clone(), probs, refined=False, allowed=c.allowed(valid + 1))


def _count_verified(stats: RunStats, drafted: int, n_acc: int, emitted: int) -> list[str]:
    """A verified step's statistics (one target pass; `drafted` deep, `n_acc` accepted); its tiers."""
    stats.target_passes += 1
    stats.steps += 1
    stats.draft_tokens += drafted
    bonus = n_acc == drafted
    stats.tier_counts["accept"] += n_acc
    stats.tier_counts["bonus" if bonus else "full"] += 1
    stats.accepted_lengths.append(emitted)
    stats.record_block(drafted, n_acc)
    return ["accept"] * n_acc + ["bonus" if bonus else "full"]


def tree_step(eng: Decoder, run: Run, g: int) -> StepResult:
    """sd over a token tree: the target verifies every branch in one pass and the longest path it
    agrees with is emitted (tree.accept_path); exact in greedy and sampling. A drafter that
    grows no tree this step (prompt lookup found a repeat) takes the chain step."""
    n = len(eng.tokens)
    t = eng.clock()
    tree = eng.drafter.propose_tree(eng.ids, n, run.tree, run.params, run.sampler, host_tokens=eng.tokens)
    run.stats.time_draft += eng.clock() - t
    if tree is None:
        return speculative_step(eng, run, g)
    run.stats.record_source(eng.drafter.tree_source)
    stats, D = run.stats, tree.max_depth
    # 3. verify: one target pass over the root and every node
    t = eng.clock()
    target_logits = eng.target.verify_tree(eng.ids, n, tree)  # [1 + N, V]
    if run.params.penalized:  # the root's row saw the context; node j's row its ancestors' tokens and its own too
        sees = torch.cat([torch.zeros_like(tree.ancestors[:1]), tree.ancestors])
        target_logits = penalized(eng, run, target_logits, tree.tokens, sees)
    if run.params.greedy:
        choices = target_logits.argmax(-1)
    else:  # one sample of the target's own distribution per row: the walk keeps the output's law
        choices = run.sampler.categorical(process_logits(target_logits, run.params))
    # 4. accept
    n_acc, path, emitted = accept_path(tree, choices)
    # 5. commit: the tokens into the buffer, the step's one read, the path's K/V into place
    eng.ids[n : n + D + 1] = emitted
    vals = eng.read(torch.cat([n_acc.view(1), path, emitted]))
    n_acc = vals[0]
    path, tokens = vals[1 : 1 + n_acc], vals[1 + D : 2 + D + n_acc]
    eng.target.keep_path(n, path)
    stats.time_verify += eng.clock() - t
    tiers = _count_verified(stats, D, n_acc, len(tokens))  # a tree counts as a block as deep as it is
    return StepResult(n, tokens, tiers, drafted=D, kept=n_acc, keep={"target": n_acc, "draft": n_acc})


# ---------------------------------------------------------------------- viasd
def tiered_step(eng: Decoder, run: Run, g: int) -> StepResult:
    """viasd: accept / slim / full tiers from one slim pass (docs/algorithm.md section 2), walked
    by router.walk_block; the target runs (once, over the whole block) only from the first 'full'."""
    proposal = _draft(eng, run, g)
    if proposal is None:
        return plain_step(eng, run)
    n, stats, th = len(eng.tokens), run.stats, run.thresholds
    g = proposal.tokens.shape[0]
    if proposal.limit is None:
        block = eng.read(proposal.tokens)  # the tiers are walked on the host
    else:  # the same read carries the proposals' count: only they are routed
        vals = eng.read(torch.cat([proposal.limit.view(1), proposal.tokens]))
        g, block = vals[0], vals[1 : vals[0] + 1]
        if g == 0:
            eng.drafter.rollback(n)  # it drafted past what it proposes
            return plain_step(eng, run)
    draft_tokens = eng.ids[n : n + g].clone()  # [g]
    stats.steps += 1
    stats.draft_tokens += g
    # 2. route: one slim pass over the block gives the gate and tier of every position
    t = eng.clock()
    slim_logits = penalized(eng, run, eng.slim.extend(eng.ids, n + g, g + 1), draft_tokens)  # [g + 1, V]
    route = route_block(slim_logits, eng.ids[n : n + g], 0.0, th.accept, th.slim)
    tier_codes = block_tiers(route, g, th).tolist()  # router.route_tiers: the one tier rule
    slim_argmax = route.argmax.tolist()  # [g + 1]
    stats.time_slim += eng.clock() - t
    stats.slim_passes += 1
    # 3. verify, lazily: one target pass over the block, at most once, from the first 'full'
    target_argmax: list[int] = []

    def target_agrees(j: int) -> bool:
        if not target_argmax:
            t = eng.clock()
            target_logits = penalized(eng, run, eng.target.extend(eng.ids, n + g, g + 1), draft_tokens)
            target_argmax.extend(target_logits.argmax(-1).tolist())
            stats.time_verify += eng.clock() - t
            stats.target_passes += 1
        return target_argmax[j] == block[j]

    # 4. accept: walk the tiers
    tiers = walk_block(tier_codes, [slim_argmax[j] == block[j] for j in range(g)], target_agrees)
    source = {"accept": block, "slim": slim_argmax, "full": target_argmax, "bonus": target_argmax}
    tokens = [source[name][j] for j, name in enumerate(tiers)]
    for name in tiers:
        stats.tier_counts[name] += 1
    # 5. commit: the emitted tokens into the buffer; each model keeps what it ran correctly
    eng.ids[n : n + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=eng.device)
    draft_valid = common_prefix(tokens, block)
    keep = {"slim": draft_valid, "draft": draft_valid}
    if target_argmax:
        keep["target"] = draft_valid  # the target ran over the drafted block too
    stats.accepted_lengths.append(len(tokens))
    stats.record_block(g, draft_valid)
    return StepResult(n, tokens, tiers, drafted=g, kept=draft_valid, keep=keep, draft_tokens=draft_tokens,
                      target_argmax=list(target_argmax) or None, route=route)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
