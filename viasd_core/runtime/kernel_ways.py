"""What runs where in a FastModel's passes, and why, in one place: `kernels_in_force` gathers every
kernel's way (float32 short products, attention by row, norms and RoPE, the packed products, int4's
prefill widening) for `viasd doctor`; `KernelWays.layer_kernels_way` says how the eager
CPU passes run their RMSNorms and RoPE (with the cache writes)."""

from __future__ import annotations

import torch
from viasd_kernels import cpu_rms_norm, cpu_rope_write

from viasd_core.runtime import attention, cpu_kernels, packed_cpu, short_products
from viasd_core.runtime.weight_format import PACKED


def kernels_in_force(fast, fmt: str) -> dict[str, str | None]:
    """How `fast` (a FastModel in weight format `fmt`) runs each kind of kernel on its device, and why:
    None for a kind it does not run (a float32 product in an int format, anything CUDA-only here)."""
    cpu = fast.device.type == "cpu"
    packed = cpu and fmt in {f.name for f in PACKED}
    return {
        "float32_products": (short_products.invariant_way() if fast.row_attention and fast.dtype == torch.float32
                             else None),
        "row_attention": attention.by_row_way(fast.row_kernel) if fast.row_attention else None,
        "layer_kernels": fast.layer_kernels_way(),
        "packed_products": packed_cpu.short_products_way() if packed else None,
        "int4_widening": packed_cpu.int4_widening_way() if packed and fmt == "int4" else None,
    }


class KernelWays:
    """Mixed into FastModel (model.py): reads the calls and kernels kernel_binding.py bound."""

    def layer_kernels_way(self) -> str | None:
        """How this model's eager CPU passes run their RMSNorms and RoPE (with the cache writes), and
        why (viasd doctor shows it); None off the CPU."""
        if self.device.type != "cpu":
            return None
        if self._final_norm != self.norm.forward:
            norm = "RMSNorm in one C call"
        else:
            weight = self.norm._parameters.get("weight")
            runs = weight is not None and cpu_kernels.rms_norm(weight.detach(), 1e-6)
            why = ("not the formula the kernel computes" if runs
                   else cpu_rms_norm.why_not() or "a weight it does not take")
            norm = f"RMSNorm through the module ({why})"
        if any(c.q_norm is not None for c in self._calls):
            rope = "RoPE through operators (per-head norms come first)"
        elif self.cache is not None and self.cache.cos.shape[-1] != self.shape.head_dim:
            rope = "RoPE through operators (partial rotary)"
        elif self.cache.kernels[0].writer is not None:
            rope = "RoPE and cache writes in one C call"
        else:
            rope = f"RoPE through operators ({cpu_rope_write.why_not() or 'the cache is not one the kernel takes'})"
        front = self.cache.kernels[0].front
        kind = "a float32" if front is not None and front.dtype == torch.float32 else "an int4"
        return f"{norm}; {rope}" + (f"; {kind} layer's calls up to its MLP in one C call" if front is not None else "")
