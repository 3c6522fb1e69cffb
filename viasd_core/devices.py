"""The device, dtype and memory facts every wing asks about."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from viasd_core.errors import UsageError, ViasdError


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device '{device}': use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ViasdError(f"device '{device}' asked for but CUDA is not available here: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"device '{device}' is not supported: use cpu, cuda or cuda:N")
    if dev.type == "cuda" and dev.index is not None:
        if dev.index >= torch.cuda.device_count():
            raise UsageError(f"device '{device}' does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(dev)  # kernels launched without a device (Triton) go to this one
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on a device (KV caches, a slim view's weights): the GPU's, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        if device.type != "cuda":
            return torch.float32
        # bf16 where the GPU has it; fp16 elsewhere (the engine stops on non-finite logits)
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise UsageError(f"unknown dtype '{dtype}': use float32, bfloat16 or float16")
    return _DTYPES[dtype]


def device_name(device: torch.device) -> str:
    """The device's own name: the GPU's, or the CPU's model name (`cpu: ...`)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
