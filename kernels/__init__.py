"""viasd_kernels: fused kernels for the engine's hot per-step work, each with a plain reference.

`route_block` routes one speculative block (row stats, gate, tiers, greedy acceptance
count; see routing.py). `int8_mm` multiplies activations by an int8 weight with per-row scales
without widening the weight in memory (int8_mm.py; the CUDA path of `--quant int8`). Each runs
its Triton kernel when its tensors are on CUDA and triton imports, and its PyTorch reference
otherwise (`run_fused`). triton is imported lazily, on the first CUDA call, so importing this
package never needs it. `tiers_from_gate` is the tier rule on its own, for gates recorded
earlier (calibration replays them).

When Triton cannot run on this machine (`cannot_run_here`: it does not import, cannot build or
compile a kernel, finds no usable GPU driver, or the GPU cannot take the compiled kernel),
`run_fused` says so once on stderr (a warning) and uses the references from then on. Any other
error from a kernel is a bug and is raised.
"""

from __future__ import annotations

import functools
import importlib
import subprocess

import torch

from .int8_mm import int8_mm, int8_mm_reference
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
    "cannot_run_here",
    "int8_mm",
    "int8_mm_reference",
    "int8_mm_triton",
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


def int8_mm_triton(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, block_n: int | None = None,
                   block_k: int | None = None) -> torch.Tensor:
    """The Triton int8 matmul kernel (triton_int8_mm.py). Raises ImportError without triton."""
    from .triton_int8_mm import int8_mm_triton as fused

    return fused(x, qdata, scale, block_n, block_k)


_triton_failed = False  # Triton could not run here: every kernel uses its reference from then on

# RuntimeError messages (triton raises plain RuntimeErrors for these) that mean "not on this machine".
_CANNOT_RUN_MESSAGES = (
    "Failed to find C compiler",  # triton.runtime.build: no gcc/clang to build its launcher
    "Failed to find C++ compiler",
    "active drivers",  # triton.runtime.driver: no (or more than one) GPU driver it can use
    "compatible backends for target",  # triton.compiler: no backend for this GPU
    "no kernel image is available",  # CUDA: the compiled kernel does not run on this GPU
    "unsupported PTX version",  # CUDA: the driver is older than the toolchain that compiled it
)


def cannot_run_here(error: BaseException) -> bool:
    """Whether an error from the Triton path means Triton cannot run on this machine (so the
    reference should), rather than a bug in the kernel or its inputs (which must surface):
    ImportError (triton or a part of it), the launcher's C build failing (CalledProcessError: no
    Python headers...), triton's CompilationError, OutOfResources (the GPU has too little shared
    memory or registers) and PTXASError, and the RuntimeErrors of _CANNOT_RUN_MESSAGES."""
    if isinstance(error, (ImportError, subprocess.CalledProcessError, *_triton_error_types())):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _CANNOT_RUN_MESSAGES)


def _triton_error_types() -> tuple[type, ...]:
    """triton's own error classes of `cannot_run_here` that this triton has (older ones lack some)."""
    found = []
    for module, name in (("triton.compiler.errors", "CompilationError"), ("triton.runtime.errors", "OutOfResources"),
                         ("triton.runtime.errors", "PTXASError")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _triton_fallback(error: Exception, kernel: str) -> None:
    """A Triton kernel cannot compile or launch here: say so once, then use the references."""
    global _triton_failed
    _triton_failed = True
    import warnings

    warnings.warn(f"viasd: the Triton {kernel} kernel is unavailable ({type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}); using the PyTorch reference", stacklevel=4)


def run_fused(kernel: str, on_cuda: bool, fused: str, reference, *args):
    """This package's Triton entry point named `fused` on CUDA tensors (`on_cuda`) while triton
    imports and has not failed here, else `reference`, with the same arguments. A failure that
    means Triton cannot run here warns once (naming `kernel`) and switches to the references for
    good; any other error is raised."""
    if on_cuda and triton_available() and not _triton_failed:
        try:
            return globals()[fused](*args)
        except Exception as e:
            if not cannot_run_here(e):
                raise  # a bug in the kernel or its inputs: the reference must not hide it
            _triton_fallback(e, kernel)  # no C compiler, an unsupported GPU...: the reference still works
    return reference(*args)


def route_block(
    verifier_logits: torch.Tensor,  # [R, V] float32 / bfloat16 / float16
    draft_tokens: torch.Tensor,  # [G] int64
    temperature: float,
    theta_accept: float,
    theta_slim: float,
) -> RouteResult:
    """Route one block of G drafted tokens; R = G or G + 1 rows (the last one the bonus)."""
    return run_fused("routing", verifier_logits.is_cuda, "route_block_triton", route_block_reference,
                     verifier_logits, draft_tokens, temperature, theta_accept, theta_slim)
