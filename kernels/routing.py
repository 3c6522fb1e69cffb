"""Tier routing and greedy acceptance for one speculative block: the plain PyTorch reference.

For a block of G drafted tokens the engine needs, per verifier row, the row max / argmax
and the log-sum-exp, and per drafted token its log-probability, the gate signal and the
tier it goes to (docs/algorithm.md section 2), plus the greedy acceptance count of section 1.
`route_block_reference` computes all of it with ordinary tensor ops; the fused Triton
kernel in `triton_routing.py` must agree with it (tests/kernels/test_kernels_routing.py).

Glossary (shapes with R = G or G + 1 verifier rows, V = vocabulary size):
- verifier_logits  [R, V]  row j scores the token at block position j; the optional
                           row G is the bonus position (argmax / max_logit / lse only).
- draft_tokens     [G]     the drafted tokens v_0 .. v_{G-1}.
- gate r_j = p(v_j) / max p = exp((logit[j, v_j] - max_logit[j]) / T), in [0, 1].
- tiers: 0 accept (r >= theta_accept), 1 slim (theta_slim <= r < theta_accept),
         2 full (r < theta_slim).
- n_match: length of the longest prefix with v_j == argmax_j (greedy acceptance count).
- first_non_accept: first j whose tier is not `accept`, or G if all are.

T is the temperature; temperature 0 (greedy) uses T = 1 for lse / logprob / gate.
All maths is float32 whatever the logits' dtype. Nothing here synchronizes with the
device: every result, counts included, is a tensor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

TIER_ACCEPT = 0
TIER_SLIM = 1
TIER_FULL = 2

SUPPORTED_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RouteResult(NamedTuple):
    argmax: torch.Tensor  # [R] int64, lowest index among ties (like torch.argmax)
    max_logit: torch.Tensor  # [R] float32
    lse: torch.Tensor  # [R] float32, logsumexp(logits / T)
    token_logprob: torch.Tensor  # [G] float32, log softmax(logits[j] / T)[draft_tokens[j]]
    gate: torch.Tensor  # [G] float32, exp((logit[j, draft_j] - max_logit[j]) / T)
    tiers: torch.Tensor  # [G] int8, TIER_ACCEPT / TIER_SLIM / TIER_FULL
    n_match: torch.Tensor  # [] int64, longest prefix with draft_tokens[j] == argmax[j]
    first_non_accept: torch.Tensor  # [] int64, first j with tiers[j] != TIER_ACCEPT, else G


def check_route_inputs(
    verifier_logits: torch.Tensor,  # [R, V]
    draft_tokens: torch.Tensor,  # [G]
    temperature: float,
    theta_accept: float,
    theta_slim: float,
) -> None:
    """Raise ValueError for anything route_block does not support. Never touches tensor data."""
    if verifier_logits.ndim != 2:
        raise ValueError(
            f"verifier_logits must be 2-D [R, V], got shape {tuple(verifier_logits.shape)}"
        )
    if draft_tokens.ndim != 1:
        raise ValueError(f"draft_tokens must be 1-D [G], got shape {tuple(draft_tokens.shape)}")
    num_rows, vocab_size = verifier_logits.shape
    num_draft = draft_tokens.shape[0]
    if num_draft < 1:
        raise ValueError("draft_tokens must hold at least one drafted token (G >= 1)")
    if vocab_size < 1:
        raise ValueError("verifier_logits has an empty vocabulary dimension (V = 0)")
    if num_rows not in (num_draft, num_draft + 1):
        raise ValueError(
            f"verifier_logits must have G or G + 1 rows for G = {num_draft} drafted tokens, "
            f"got {num_rows} rows"
        )
    if verifier_logits.dtype not in SUPPORTED_LOGIT_DTYPES:
        raise ValueError(
            f"verifier_logits must be float32, bfloat16 or float16, got {verifier_logits.dtype}"
        )
    if draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    if draft_tokens.device != verifier_logits.device:
        raise ValueError(
            f"draft_tokens is on {draft_tokens.device} but verifier_logits is on "
            f"{verifier_logits.device}; put both on the same device"
        )
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    # The gate r is at most 1, so a threshold above 1 switches its tier off (up to 2 allowed).
    if not (0.0 <= theta_slim <= theta_accept <= 2.0):
        raise ValueError(
            "thresholds must satisfy 0 <= theta_slim <= theta_accept <= 2 (above 1 disables a tier), "
            f"got theta_slim={theta_slim}, theta_accept={theta_accept}"
        )


def tiers_from_gate(gate: torch.Tensor, theta_accept: float, theta_slim: float) -> torch.Tensor:
    """The tier rule: gate [N] float32 -> tiers [N] int8 (a NaN gate goes to TIER_FULL).

    The comparisons are float32 (a Python threshold is rounded to float32, as in the Triton
    kernel), so gates recorded from a RouteResult and routed again here land in the same
    tiers as they did in route_block.
    """
    gate = gate.float()
    tiers = torch.full(gate.shape, TIER_FULL, dtype=torch.int8, device=gate.device)
    tiers = torch.where(gate >= theta_slim, TIER_SLIM, tiers)
    return torch.where(gate >= theta_accept, TIER_ACCEPT, tiers).to(torch.int8)


def inverse_temperature(temperature: float) -> float:
    """1 / T, with T = 1 for greedy (temperature 0)."""
    return 1.0 / temperature if temperature > 0.0 else 1.0


def route_block_reference(
    verifier_logits: torch.Tensor,  # [R, V] float32 / bfloat16 / float16
    draft_tokens: torch.Tensor,  # [G] int64
    temperature: float,
    theta_accept: float,
    theta_slim: float,
) -> RouteResult:
    """Plain-PyTorch routing of one block. Materializes [R, V] float32 tensors; slow but obvious.

    draft_tokens must lie in [0, V) (not checked: that would need a host sync; an
    out-of-range token raises in torch.gather here).
    """
    check_route_inputs(verifier_logits, draft_tokens, temperature, theta_accept, theta_slim)
    num_draft = draft_tokens.shape[0]
    inv_temperature = inverse_temperature(temperature)

    # 1. Row statistics over the whole vocabulary, in float32.
    logits = verifier_logits.float()  # [R, V]
    argmax = torch.argmax(logits, dim=-1)  # [R]
    max_logit = logits.gather(-1, argmax[:, None]).squeeze(-1)  # [R]
    lse = torch.logsumexp(logits * inv_temperature, dim=-1)  # [R]

    # 2. The drafted token of each block position.
    draft_logit = logits[:num_draft].gather(-1, draft_tokens[:, None]).squeeze(-1)  # [G]
    token_logprob = draft_logit * inv_temperature - lse[:num_draft]  # [G]
    gate = torch.exp((draft_logit - max_logit[:num_draft]) * inv_temperature)  # [G]

    # 3. Tiers from the two gate thresholds.
    tiers = tiers_from_gate(gate, theta_accept, theta_slim)  # [G]

    # 4. Greedy acceptance count and the first position that is not accepted by the gate.
    positions = torch.arange(num_draft, device=draft_tokens.device)  # [G]
    no_position = torch.full_like(positions, num_draft)  # [G]
    mismatch = draft_tokens != argmax[:num_draft]  # [G]
    n_match = torch.where(mismatch, positions, no_position).min()
    first_non_accept = torch.where(tiers != TIER_ACCEPT, positions, no_position).min()

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
