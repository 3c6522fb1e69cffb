"""The RMSNorm calls of FastModel's pass: viasd_kernels' one-call kernel where it computes what the
module computes.

A decoder layer calls its RMSNorm twice a pass, and transformers' runs eight PyTorch operators a
call: about 1 ms of a 7 ms 1-token int4 SmolLM2 pass on a 2-core AMD EPYC. `norm_call(module)`
returns the callable the pass uses instead of `module.forward`: viasd_kernels.cpu_rms_norm bound to
the module's weight where the module is a CPU RMSNorm whose output the kernel reproduces on a probe
(within a rounding step: the kernel sums the squares in its own order), else the module's own
forward (other norms, such as Gemma's `1 + weight`, other devices, a kernel that cannot be built).
Traced passes (torch.compile), inputs of another dtype and inputs that need gradients (the kernel
has no backward) call the module, as does a module whose weight was replaced after the call was made.
"""

from __future__ import annotations

from typing import Callable

import torch
from viasd_kernels import cpu_rms_norm

from viasd_core import paths

Call = Callable[[torch.Tensor], torch.Tensor]
PROBE_ROWS = 3


def _agrees(module: torch.nn.Module, norm: cpu_rms_norm.Norm) -> bool:
    """Whether the kernel gives the module's output on a probe: every value within a rounding step
    of the dtype (the formula is then the same; only the order of one sum differs)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(PROBE_ROWS, norm.h, generator=g) * 3).to(norm.dtype)
    with torch.no_grad():
        want = module.forward(x).to(norm.dtype)
        got = norm(x)
    step = 2.0**-7 if norm.dtype == torch.bfloat16 else 2.0**-20
    return want.shape == got.shape and bool(((got.float() - want.float()).abs() <= step * want.float().abs()).all())


def norm_call(module: torch.nn.Module) -> Call:
    """`module`'s norm as the pass calls it (see the module doc)."""
    params = module._parameters
    weight = params.get("weight")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if weight is None or not isinstance(eps, float):
        return module.forward
    norm = cpu_rms_norm.bind(weight.detach(), eps, build_dir=paths.kernel_dir())
    if norm is None or not _agrees(module, norm):
        return module.forward
    dtype, forward = norm.dtype, module.forward

    def call(x: torch.Tensor) -> torch.Tensor:
        if (x.dtype is not dtype or params["weight"] is not weight or x.requires_grad
                or torch.compiler.is_compiling()):
            return forward(x)
        return norm(x)

    call.kernel = norm  # the bound kernel, for a pass that calls it from C (viasd_kernels.cpu_layer)
    return call
