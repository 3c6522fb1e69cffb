"""The AVX2 class in force for a test: natively on an AVX2 CPU, under VIASD_MAX_CPU_ISA=avx2 on a CPU
above it, skipped below it (ARM, x86 without AVX2)."""

from __future__ import annotations

import os
import platform

import pytest
from viasd_kernels import instruction_set


def enter_avx2(monkeypatch) -> None:
    """Puts the AVX2 class in force for the test (the cap where this CPU is above it), or skips."""
    own = instruction_set.cpu_isa_class()
    monkeypatch.delenv(instruction_set.ISA_ENV, raising=False)
    if own in ("avx512", "avx512_bf16"):
        monkeypatch.setenv(instruction_set.ISA_ENV, "avx2")
    elif own != "avx2":
        pytest.skip(f"this CPU's class is {own}: no AVX2 build to test")


def built_or_skip(built: bool, what: str, why: str | None) -> None:
    """Skips where `what` did not build for the AVX2 class here; fails instead under CI on x86-64."""
    if not built:
        assert not (os.environ.get("CI") and platform.machine() == "x86_64"), f"{what} must build in CI: {why}"
        pytest.skip(f"{what} does not run here: {why}")
