"""The instruction-set cap (VIASD_MAX_CPU_ISA) for PyTorch's own CPU kernels, as for viasd's.

viasd_kernels.cpu_build reads the cap and builds viasd's C kernels for the class in force (the lower
of the CPU's own and the cap: avx2, avx512, avx512_bf16). The passes also run PyTorch's kernels
(int4/int8 products where viasd's do not run, attention, prefill products), which choose their code
by the CPU too: ATen dispatches by `ATEN_CPU_CAPABILITY` (default, avx2, avx512), oneDNN by
`ONEDNN_MAX_CPU_ISA` and MKL (float32 products: F.linear, transformers' baseline) by
`MKL_ENABLE_INSTRUCTIONS`, which MKL reads at its first call. `apply()` sets the three from the class in force, so that one variable makes a
machine run every kernel as a CPU of the lower class would: how viasd tests and measures the classes
a developer's CPU is above. It runs when viasd_core is imported, before any tensor operation (ATen
reads its variable at its first dispatch); a value the user set for any of them is kept.
"""

from __future__ import annotations

import os

ATEN = {"none": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512"}
ONEDNN = {"none": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16"}
MKL = {"none": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512_E1", "avx512_bf16": "AVX512_E3"}  # E1: VNNI; E3: + BF16, no AMX


def apply() -> str | None:
    """Point PyTorch's CPU kernels at the class VIASD_MAX_CPU_ISA allows; the class, or None where no
    cap is set (or the CPU is not x86-64). An unknown value is left for the first kernel build to
    refuse with its one line (viasd_kernels.instruction_set.max_isa)."""
    if not os.environ.get("VIASD_MAX_CPU_ISA", "").strip():
        return None
    from viasd_kernels import instruction_set

    try:
        if instruction_set.max_isa() == "native":
            return None
    except ValueError:
        return None
    now = instruction_set.isa_class()
    if now not in ATEN:
        return None
    os.environ.setdefault("ATEN_CPU_CAPABILITY", ATEN[now])
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN[now])
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", MKL[now])
    return now


def in_force() -> tuple[str, str]:
    """(the instruction-set class viasd's kernels are built for, one line saying it and any cap) for
    `--verbose` and doctor."""
    from viasd_kernels import instruction_set

    return instruction_set.isa_class(), instruction_set.describe_isa()
