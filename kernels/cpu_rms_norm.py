"""RMSNorm in one call for a CPU's passes.

transformers' RMSNorm (Llama, Qwen2/3, Mistral, Phi-3) runs eight PyTorch operators a call; a
decoder layer calls it twice, so a 1-token int4 SmolLM2 pass spent about 1 ms of its ~7 ms in
norms on a 2-core AMD EPYC. `bind` returns the same formula as one C call over the module's weight
(cpu_rms_norm.c says how), for float32 and bfloat16 rows on the CPU.

- **Kernel**: `bind(weight, eps, build_dir=...)` -> `Norm` (`norm(x)` for x [..., H] contiguous, in
  the weight's dtype), or None where it does not apply or cannot be built (the caller keeps the
  module's own forward). Whether a module computes this formula at all is the caller's check
  (viasd_core/runtime/norms.py compares the two on a probe before it takes the kernel).
- **Reference**: `rms_norm_reference`, transformers' formula with PyTorch's operators
  (tests/kernels/test_kernels_cpu_rms_norm.py compares them, and checks that a row's result does not depend
  on the rows beside it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).with_name("cpu_rms_norm.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LANES = 16  # the C file's limit: the width a multiple of 16


def _function(build_dir: Path):
    return cpu_build.function(SOURCE, build_dir, "viasd_rms_norm")


def _takes(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 1
            and weight.shape[0] % LANES == 0 and weight.is_contiguous())


def why_not() -> str | None:
    """Why the kernel could not be built here (None: it was, or was not tried yet)."""
    return cpu_build.why_not(SOURCE)


class Norm:
    """One module's RMSNorm, bound to its weight: `norm(x)` for x [..., H] in the weight's dtype on
    the CPU -> a new tensor of x's shape. A pass calls it twice a layer, so it checks what it hands
    the kernel in one expression (~0.3 us), allocates the output and calls the kernel. A weight whose
    storage was replaced (`.data =`) is bound again where the kernel takes it, else refused: the
    kernel never reads the freed one."""

    __slots__ = ("fn", "weight", "ptr", "eps", "dtype", "code", "h")

    def __init__(self, fn, weight: torch.Tensor, eps: float):
        self.fn, self.weight, self.eps = fn, weight, eps
        self.ptr, self.dtype, self.code, self.h = weight.data_ptr(), weight.dtype, DTYPES[weight.dtype], weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not self.dtype or not x.is_cpu or x.shape[-1] != self.h:
            raise ValueError(f"RMSNorm kernel bound to [{self.h}] {self.dtype} got {tuple(x.shape)} {x.dtype} "
                             f"on {x.device}")
        if self.weight.data_ptr() != self.ptr:
            self.check()
        x = x.contiguous()
        out = torch.empty_like(x)
        if self.fn(x.data_ptr(), self.ptr, out.data_ptr(), x.numel() // self.h, self.h, self.eps, self.code) != 0:
            raise ValueError(f"RMSNorm kernel refused x {tuple(x.shape)}")
        return out

    def check(self) -> None:
        """Binds the weight again if its storage moved (`.data =`); ValueError where the kernel does not
        take the new one."""
        w = self.weight
        if w.data_ptr() != self.ptr:
            if not (_takes(w) and w.dtype is self.dtype and w.shape[0] == self.h):
                raise ValueError(f"RMSNorm kernel's weight was replaced by {tuple(w.shape)} {w.dtype} on {w.device}, "
                                 f"not [{self.h}] {self.dtype} on the CPU: bind it again")
            self.ptr = w.data_ptr()


def bind(weight: torch.Tensor, eps: float, *, build_dir: Path) -> Norm | None:
    """The kernel over `weight` [H] (float32 or bfloat16, on the CPU, H a multiple of 16), or None
    where it does not take it or cannot be built here."""
    fn = _function(build_dir) if _takes(weight) else None
    return None if fn is None else Norm(fn, weight, float(eps))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (LlamaRMSNorm.forward) with PyTorch's operators."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
