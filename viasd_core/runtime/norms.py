"""The RMSNorm calls of FastModel's pass: viasd_kernels' one-call kernel where it computes what the
module computes.

A decoder layer calls its RMSNorm twice a pass, and transformers' runs eight PyTorch operators a
call: about 1 ms of a 7 ms 1-token int4 SmolLM2 pass on a 2-core AMD EPYC. `norm_calls(module)`
decides once what a pass calls instead of `module.forward`: viasd_kernels.cpu_rms_norm bound to the
module's weight where the module is a CPU RMSNorm whose output the kernel reproduces on a probe
(within a rounding step: the kernel sums the squares in its own order), else the module's own
forward (other norms, such as Gemma's `1 + weight`, other devices, a kernel that cannot be built);
traced passes call the module. FastModel's passes and the EAGLE head's (head_calls.py) call one or
the other as their plan says (no call asks which); each binds again when a weight is replaced.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from viasd_kernels import cpu_rms_norm

from viasd_core.runtime import cpu_kernels

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


class NormCalls(NamedTuple):
    """A norm's calls, decided once (`norm_calls`): `eager` what an eager pass calls (the kernel
    bound to the module's weight, `kernel`, where it computes what the module does, else the
    module's forward), `traced` what a traced pass calls (the module's forward)."""

    eager: Call
    traced: Call
    kernel: cpu_rms_norm.Norm | None


def norm_calls(module: torch.nn.Module) -> NormCalls:
    """`module`'s norm as passes call it (see the module doc), decided now from its weight. The
    kernel takes inputs of its weight's dtype that need no gradient; a pass that binds these calls
    (FastModel: its eager passes run under inference mode, in the model's dtype) binds them again
    when a weight is replaced (FastModel.bind_kernels)."""
    forward = module.forward
    weight = module._parameters.get("weight")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if weight is None or not isinstance(eps, float):
        return NormCalls(forward, forward, None)
    norm = cpu_kernels.rms_norm(weight.detach(), eps)
    if norm is None or not _agrees(module, norm):
        return NormCalls(forward, forward, None)
    return NormCalls(norm, forward, norm)
