"""Tier routing and greedy acceptance for one speculative block: the fused Triton kernels.

Same contract as `routing.route_block_reference` (read its module docstring for the
glossary). Two launches, no host-device synchronization:

1. `_route_rows_kernel`, one program per verifier row: a single chunked pass over the
   vocabulary keeps a per-lane running max, the index of that max and a running
   sum of exp((x - max) / T) (online softmax), then reduces the lanes to the row's
   argmax (lowest index among ties), max_logit and lse. Rows j < G also read the drafted
   token's logit and write its log-probability, gate and tier. No [R, V] temporary.
2. `_block_summary_kernel`, one program: n_match and first_non_accept from the G
   argmaxes and tiers of step 1.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when this module is
imported: set TRITON_INTERPRET=1 before importing it to run the kernels on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .routing import (
    TIER_ACCEPT,
    TIER_FULL,
    TIER_SLIM,
    RouteResult,
    check_route_inputs,
    inverse_temperature,
)

MAX_BLOCK_V = 4096

# Module constants used inside kernels must be constexpr.
_ACCEPT = tl.constexpr(TIER_ACCEPT)
_SLIM = tl.constexpr(TIER_SLIM)
_FULL = tl.constexpr(TIER_FULL)


@triton.jit
def _route_rows_kernel(
    logits_ptr,  # [R, V] float32 / bfloat16 / float16, unit stride along V
    draft_ptr,  # [G] int64
    argmax_ptr,  # [R] int64 out
    max_logit_ptr,  # [R] float32 out
    lse_ptr,  # [R] float32 out
    token_logprob_ptr,  # [G] float32 out
    gate_ptr,  # [G] float32 out
    tiers_ptr,  # [G] int8 out
    stride_row,
    vocab_size,
    num_draft,
    inv_temperature,
    theta_accept,
    theta_slim,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lane = tl.arange(0, BLOCK_V)

    # 1. One pass over V, lane-wise: lane i sees columns i, i + BLOCK_V, i + 2 BLOCK_V, ...
    #    Columns are visited in increasing order, so a strict ">" keeps each lane's lowest
    #    index among ties. Masked tail columns read -inf and never win.
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_argmax = lane  # an all -inf lane falls back to its first column, like torch.argmax
    lane_sum = tl.zeros([BLOCK_V], tl.float32)  # sum of exp((x - lane_max) / T)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + lane
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # exp(-inf - -inf) would be NaN: shift an all -inf lane by 0 instead (both terms are 0).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp((lane_max - shift) * inv_temperature) + tl.exp(
            (x - shift) * inv_temperature
        )
        lane_argmax = tl.where(x > lane_max, cols, lane_argmax)
        lane_max = new_max

    # 2. Reduce the lanes.
    max_logit = tl.max(lane_max, axis=0)
    argmax = tl.min(tl.where(lane_max == max_logit, lane_argmax, vocab_size), axis=0)
    row_shift = tl.where(max_logit == float("-inf"), 0.0, max_logit)
    lane_scale = tl.exp((lane_max - row_shift) * inv_temperature)
    lse = row_shift * inv_temperature + tl.log(tl.sum(lane_sum * lane_scale, axis=0))
    tl.store(argmax_ptr + row, argmax.to(tl.int64))
    tl.store(max_logit_ptr + row, max_logit)
    tl.store(lse_ptr + row, lse)

    # 3. The drafted token of this block position (rows j < G; the bonus row stops above).
    #    An out-of-range token reads NaN, so its gate is NaN and it routes to the full tier.
    is_draft = row < num_draft
    token = tl.load(draft_ptr + row, mask=is_draft, other=0)
    in_vocab = is_draft & (token >= 0) & (token < vocab_size)
    draft_logit = tl.load(row_ptr + token, mask=in_vocab, other=float("nan")).to(tl.float32)
    token_logprob = draft_logit * inv_temperature - lse
    gate = tl.exp((draft_logit - max_logit) * inv_temperature)
    tier = tl.where(gate >= theta_accept, _ACCEPT, tl.where(gate >= theta_slim, _SLIM, _FULL))
    tl.store(token_logprob_ptr + row, token_logprob, mask=is_draft)
    tl.store(gate_ptr + row, gate, mask=is_draft)
    tl.store(tiers_ptr + row, tier.to(tl.int8), mask=is_draft)


@triton.jit
def _block_summary_kernel(
    draft_ptr,  # [G] int64
    argmax_ptr,  # [R] int64, from _route_rows_kernel
    tiers_ptr,  # [G] int8, from _route_rows_kernel
    n_match_ptr,  # [] int64 out
    first_non_accept_ptr,  # [] int64 out
    num_draft,
    BLOCK_G: tl.constexpr,
):
    position = tl.arange(0, BLOCK_G)
    valid = position < num_draft
    token = tl.load(draft_ptr + position, mask=valid, other=0)
    argmax = tl.load(argmax_ptr + position, mask=valid, other=0)
    tier = tl.load(tiers_ptr + position, mask=valid, other=_ACCEPT)
    mismatch = valid & (token != argmax)
    not_accepted = valid & (tier != _ACCEPT)
    n_match = tl.min(tl.where(mismatch, position, num_draft), axis=0)
    first_non_accept = tl.min(tl.where(not_accepted, position, num_draft), axis=0)
    tl.store(n_match_ptr, n_match.to(tl.int64))
    tl.store(first_non_accept_ptr, first_non_accept.to(tl.int64))


def default_block_v(vocab_size: int) -> int:
    """Chunk width along V: the vocabulary rounded up to a power of two, at most MAX_BLOCK_V."""
    return min(triton.next_power_of_2(vocab_size), MAX_BLOCK_V)


def route_block_triton(
    verifier_logits: torch.Tensor,  # [R, V] float32 / bfloat16 / float16
    draft_tokens: torch.Tensor,  # [G] int64
    temperature: float,
    theta_accept: float,
    theta_slim: float,
    block_v: int | None = None,
) -> RouteResult:
    """Fused routing of one block; returns device tensors without synchronizing.

    block_v: chunk width along V (a power of two); default `default_block_v(V)`. The
    Triton interpreter (TRITON_INTERPRET=1) runs much faster with a large one.
    """
    check_route_inputs(verifier_logits, draft_tokens, temperature, theta_accept, theta_slim)
    if block_v is None:
        block_v = default_block_v(verifier_logits.shape[1])
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if verifier_logits.stride(-1) != 1:
        verifier_logits = verifier_logits.contiguous()
    draft_tokens = draft_tokens.contiguous()
    num_rows, vocab_size = verifier_logits.shape
    num_draft = draft_tokens.shape[0]
    device = verifier_logits.device

    argmax = torch.empty(num_rows, dtype=torch.int64, device=device)
    max_logit = torch.empty(num_rows, dtype=torch.float32, device=device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    token_logprob = torch.empty(num_draft, dtype=torch.float32, device=device)
    gate = torch.empty(num_draft, dtype=torch.float32, device=device)
    tiers = torch.empty(num_draft, dtype=torch.int8, device=device)
    n_match = torch.empty((), dtype=torch.int64, device=device)
    first_non_accept = torch.empty((), dtype=torch.int64, device=device)

    _route_rows_kernel[(num_rows,)](
        verifier_logits,
        draft_tokens,
        argmax,
        max_logit,
        lse,
        token_logprob,
        gate,
        tiers,
        verifier_logits.stride(0),
        vocab_size,
        num_draft,
        inverse_temperature(temperature),
        theta_accept,
        theta_slim,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    _block_summary_kernel[(1,)](
        draft_tokens,
        argmax,
        tiers,
        n_match,
        first_non_accept,
        num_draft,
        BLOCK_G=max(triton.next_power_of_2(num_draft), 16),
        num_warps=1,
    )
    return RouteResult(
        argmax=argmax,
        max_logit=max_logit,
        lse=lse,
        token_logprob=token_logprob,
        gate=gate,
        tiers=tiers,
        n_match=n_match,
        first_non_accept=first_non_accept,
    )
