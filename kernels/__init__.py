"""viasd_kernels: fused kernels for the engine's hot per-step work, each with a plain reference.

`route_block` routes one speculative block (row stats, gate, tiers, greedy acceptance
count; see routing.py). It runs the Triton kernel when the logits are on CUDA and
triton imports, and the PyTorch reference otherwise. triton is imported lazily, on the
first CUDA call, so importing this package never needs it. `tiers_from_gate` is the tier
rule on its own, for gates recorded earlier (calibration replays them).
"""

from __future__ import annotations

import functools

import torch

from .routing import (
    TIER_ACCEPT,
    TIER_FULL,
    TIER_SLIM,
    RouteResult,
    route_block_reference,
    tiers_from_gate,
)

__all__ = [
    "TIER_ACCEPT",
    "TIER_FULL",
    "TIER_SLIM",
    "RouteResult",
    "route_block",
    "route_block_reference",
    "route_block_triton",
    "tiers_from_gate",
    "triton_available",
]


@functools.cache
def triton_available() -> bool:
    """True when triton imports (it is an optional dependency on CPU-only machines)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def route_block_triton(
    verifier_logits: torch.Tensor,  # [R, V] float32 / bfloat16 / float16
    draft_tokens: torch.Tensor,  # [G] int64
    temperature: float,
    theta_accept: float,
    theta_slim: float,
    block_v: int | None = None,
) -> RouteResult:
    """The fused Triton kernel (triton_routing.py). Raises ImportError without triton."""
    from .triton_routing import route_block_triton as fused

    return fused(verifier_logits, draft_tokens, temperature, theta_accept, theta_slim, block_v)


_triton_failed = False


def _triton_fallback(error: Exception) -> None:
    """The Triton kernel could not compile or launch here: say so once, then use the reference."""
    global _triton_failed
    _triton_failed = True
    import warnings

    warnings.warn(f"viasd: the Triton routing kernel is unavailable ({type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}); using the PyTorch reference", stacklevel=3)


def route_block(
    verifier_logits: torch.Tensor,  # [R, V] float32 / bfloat16 / float16
    draft_tokens: torch.Tensor,  # [G] int64
    temperature: float,
    theta_accept: float,
    theta_slim: float,
) -> RouteResult:
    """Route one block of G drafted tokens; R = G or G + 1 rows (the last one the bonus)."""
    if verifier_logits.is_cuda and triton_available() and not _triton_failed:
        try:
            return route_block_triton(
                verifier_logits, draft_tokens, temperature, theta_accept, theta_slim
            )
        except Exception as e:  # no C compiler, an unsupported GPU...: the reference still works
            _triton_fallback(e)
    return route_block_reference(
        verifier_logits, draft_tokens, temperature, theta_accept, theta_slim
    )
