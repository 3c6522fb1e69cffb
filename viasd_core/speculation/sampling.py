"""Pure functions: logits processing, the speculative acceptance rule, and the randomness seam.

Names follow docs/algorithm.md (section 0): `draft_`, `slim_`, `target_` prefixes; never bare p and q.
All probability maths is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; applied to logits before everything else (`penalize`)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0


def presence(ids: torch.Tensor, width: int) -> torch.Tensor:
    """[width] bool: which token ids occur in `ids` (the committed context, ids[:n] of the buffer).
    Built on the device from the buffer itself at each step (no host read, no state to keep in step
    with rollbacks, reused prefixes or a server's slots)."""
    return torch.zeros(width, dtype=torch.bool, device=ids.device).index_fill_(0, ids, True)


def presence_rows(history: torch.Tensor, tokens: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: row r's context is `history` [V] plus the tokens [g] it sees (`sees` [R, g] bool).
    One scatter on the device, no host read."""
    R, V = sees.shape[0], history.shape[0]
    hits = torch.zeros(R, V, dtype=torch.int32, device=history.device)
    hits.scatter_add_(1, tokens.view(1, -1).expand(R, -1), sees.int())
    return (hits > 0) | history


def chain_presence(history: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[g + 1, V] bool for a block of `tokens` [g] after the committed context: row j (the logits
    that choose block position j; row g the bonus) saw `history` and tokens[:j]."""
    g = tokens.shape[0]
    sees = torch.ones(g + 1, g, dtype=torch.bool, device=tokens.device).tril(-1)
    return presence_rows(history, tokens, sees)


def penalize(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """The repetition penalty (transformers' and vLLM's rule) on logits [N, V] in float32: a token
    already in the row's context (`seen` [N, V] or [V] bool; None: no penalty) has its logit divided
    by `penalty` when positive, multiplied when negative. The one place the rule lives: greedy choices
    and `process_logits` both read its output, for draft, slim and target rows alike."""
    if seen is None or penalty == 1.0:
        return logits
    logits = logits.float()
    hit = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, hit, logits)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to logits [N, V]; returns probabilities [N, V] in fp32.

    The same function is applied to draft and target logits, so both models sample from
    the distributions the acceptance rule compares. min-p (vLLM's and transformers' rule, last, as
    transformers orders it): a token is dropped when its probability, after the filters before it,
    is below min_p times the most likely token's (which is always kept).
    """
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps at least one).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    """The one place randomness comes from: a seeded torch.Generator on the decoding device.

    Every draw stays on the device (no host round trip per token). Tests may replace it.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))

    def uniform(self, n: int, device) -> torch.Tensor:
        return torch.rand(n, generator=self.generator, device=self.generator.device).to(device)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        """One sample per row of probs [N, V] -> [N] int64, on the device (exponential race).

        argmax_v probs[v] / E_v with E_v ~ Exp(1) i.i.d. picks v with probability probs[v] / sum:
        the exact categorical distribution, without multinomial's host synchronization.
        """
        race = torch.empty(probs.shape, dtype=torch.float32, device=self.generator.device)
        race.exponential_(generator=self.generator)
        return (probs.float() / race.to(probs.device)).argmax(-1)


def prefix_length(matches: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in matches [G] bool -> [] int64 (no host read)."""
    return matches.int().cumprod(0).sum()


def proposed(num_draft: int, limit: torch.Tensor | None, device) -> torch.Tensor:
    """[G] bool: which block positions hold a proposal. A drafter that decides on the device where
    its block ends (the confidence stop) drafts G tokens and reports `limit` ([] int64): positions
    from `limit` on are no proposals, however they compare."""
    idx = torch.arange(num_draft, device=device)
    return idx < limit if limit is not None else torch.ones(num_draft, dtype=torch.bool, device=device)


def greedy_accept(draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                  limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of one block.

    draft_tokens:  [G] int64, the proposed tokens.
    target_argmax: [G + 1] int64, the target's choice at each block position and the bonus position.
    limit:         [] int64 or None, the proposals' count (see `proposed`); None: all G.
    Returns (emitted [G + 1] int64, n_accepted [] int64): the emitted tokens are the accepted
    draft prefix followed by the target's token at the first mismatch (or the bonus token);
    only the first n_accepted + 1 entries are meaningful.
    """
    G = draft_tokens.shape[0]
    assert target_argmax.shape[0] == G + 1, (draft_tokens.shape, target_argmax.shape)
    n_accepted = prefix_length((draft_tokens == target_argmax[:G]) & proposed(G, limit, draft_tokens.device))
    return target_argmax, n_accepted  # target_argmax[:n] == draft_tokens[:n] on the accepted prefix


def speculative_sample(
    draft_tokens: torch.Tensor,  # [G] int64
    draft_probs: torch.Tensor,  # [G, V] float32, the distribution each draft token was sampled from
    target_probs: torch.Tensor,  # [G + 1, V] float32
    uniforms: torch.Tensor,  # [G] float32 in [0, 1)
    sampler: Sampler,
    limit: torch.Tensor | None = None,  # [] int64, the proposals' count (see `proposed`); None: all G
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative sampling rule (Leviathan et al.; Chen et al.), without host reads.

    Accept draft token x_j with probability min(1, target_probs[j, x] / draft_probs[j, x]);
    at the first rejection sample from normalize(max(0, target_probs[j] - draft_probs[j])) and
    drop the rest; if all are accepted, sample the bonus token from target_probs[G].
    Returns (emitted [G + 1] int64, n_accepted [] int64), like `greedy_accept`: only the first
    n_accepted + 1 entries are meaningful. Every row's recovery token is drawn (independently of
    the acceptance draws) and the one at n_accepted is kept, so the count never leaves the device.
    A position past `limit` holds no proposal: it is never accepted and its draft distribution
    counts as zero, so its recovery token is the target's own (as for the bonus token).
    """
    G = draft_tokens.shape[0]
    assert draft_probs.shape[0] == G and target_probs.shape[0] == G + 1
    idx = torch.arange(G, device=draft_tokens.device)
    is_proposal = proposed(G, limit, draft_tokens.device)
    if limit is not None:
        draft_probs = draft_probs * is_proposal[:, None]
    p_draft = draft_probs[idx, draft_tokens]
    p_target = target_probs[idx, draft_tokens]
    # u < p_target / p_draft, written without division (p_draft > 0 for a token it sampled).
    n_accepted = prefix_length((uniforms * p_draft < p_target) & is_proposal)
    residual = (target_probs[:G] - draft_probs).clamp_min(0)  # [G, V]
    total = residual.sum(-1, keepdim=True)
    # identical distributions: a rejection is impossible in exact arithmetic; fall back to the target
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs[:G])
    recovery = sampler.categorical(torch.cat([residual, target_probs[G:]]))  # [G + 1]
    emitted = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
    positions = torch.arange(G + 1, device=draft_tokens.device)
    emitted = torch.where(positions == n_accepted, recovery, emitted)
    return emitted, n_accepted
