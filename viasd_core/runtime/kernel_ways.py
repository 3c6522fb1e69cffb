"""What `viasd doctor` says of a FastModel's C kernels: how its eager CPU passes run their RMSNorms
and RoPE (with the cache writes), and why."""

from __future__ import annotations

from viasd_kernels import cpu_rms_norm, cpu_rope_write

from viasd_core.runtime import cpu_kernels


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
        front = self.cache.kernels[0].front is not None
        return f"{norm}; {rope}" + ("; an int4 layer's calls up to its MLP in one C call" if front else "")
