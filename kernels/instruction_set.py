"""The instruction-set class the C kernels are built for: this CPU's own, and the cap
VIASD_MAX_CPU_ISA sets (avx2, avx512, avx512_bf16, native; like oneDNN's ONEDNN_MAX_CPU_ISA): the
kernels build with -march=native less every extension above the cap (cpu_flags.py), and the cap is
part of the built library's key (cpu_build.py). `isa_class()` is the class in force, `describe_isa()`
says it in a line."""

from __future__ import annotations

import os
import platform

ISA_ENV = "VIASD_MAX_CPU_ISA"
ISA_CLASSES = ("none", "avx2", "avx512", "avx512_bf16")  # x86-64's, lowest first; 'neon' on aarch64
CAPS = ("avx2", "avx512", "avx512_bf16", "native")
_ISA_SAYS = {
    "none": "no AVX2 (plain x86-64 code)",
    "avx2": "AVX2 and FMA",
    "avx512": "AVX-512 F/BW/VL/DQ and VNNI, no BF16",
    "avx512_bf16": "AVX-512 F/BW/VL/DQ, VNNI and BF16",
    "neon": "ARM NEON",
}


def cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and instruction-set flags, where readable."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features") and line not in parts:
                    parts.append(line)
                if line.strip() == "":
                    break  # the first processor says it for all
    except OSError:
        parts.append(platform.processor())
    return "".join(parts)


def cpu_isa_class() -> str:
    """This CPU's own instruction-set class: from /proc/cpuinfo's flags on Linux x86-64, 'neon' on
    aarch64, 'none' where neither says more."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    flags: set[str] = set()
    for line in cpu_identity().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags
    if avx512 and "avx512_bf16" in flags:
        return "avx512_bf16"
    if avx512:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "none"


def max_isa() -> str:
    """The cap VIASD_MAX_CPU_ISA sets ('native': none); ValueError for a value it does not know."""
    cap = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if cap not in CAPS:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not one of {', '.join(CAPS)}")
    return cap


def isa_class() -> str:
    """The instruction-set class the kernels are built for: the lower of the CPU's own and the cap
    (a cap names x86-64 classes: on other CPUs it changes nothing)."""
    own, cap = cpu_isa_class(), max_isa()
    if cap == "native" or own not in ISA_CLASSES:
        return own
    return min(own, cap, key=ISA_CLASSES.index)


def describe_isa() -> str:
    """One line for `viasd doctor`: the class in force, what it holds, and the cap if one applies."""
    own, cap, now = cpu_isa_class(), max_isa(), isa_class()
    line = f"{now}: {_ISA_SAYS[now]}"
    if now != own:
        return f"{line} (capped by {ISA_ENV}={cap}; this CPU: {own})"
    return line + (f" ({ISA_ENV}={cap} is no lower)" if cap != "native" and own in ISA_CLASSES else "")
