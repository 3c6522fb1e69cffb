"""The device, dtype and memory facts every wing asks about."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from viasd_core import paths
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


def machine_identity(device: torch.device) -> dict:
    """What a cached measurement of this machine is keyed by: the device's name, on a CPU the
    instruction set PyTorch's kernels use here (AVX512, AVX2, ...), the class in force and the usable cores, and
    PyTorch's version. A cached choice is measured again when any of them changes."""
    identity = {"device": device_name(device), "torch": torch.__version__}
    if device.type == "cpu":
        from viasd_kernels import cpu_build

        identity["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        # the class viasd's kernels and oneDNN/MKL run (VIASD_MAX_CPU_ISA): ATen's capability does not
        # tell AVX-512 with BF16 from AVX-512 without it, and bfloat16 products pay only with it
        identity["isa_class"] = cpu_build.isa_class()
        identity["cores"] = usable_cores()
    return identity


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_cache(kind: str, device: torch.device, key: dict) -> Path:
    """The file that caches a measurement of this machine: `kind`-DIGEST.json in the user's cache
    folder, DIGEST naming the machine's identity, the thread count and `key` (what was measured)."""
    blob = json.dumps({**machine_identity(device), "threads": torch.get_num_threads(), **key}, sort_keys=True)
    return paths.cache_dir() / "machine" / f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"


class MachineRecord:
    """One cached measurement of this machine (the `auto` choices: weight format, compilation, tree,
    short products): a JSON file at `machine_cache(kind, device, key + version)`.

    `store` writes the record with what it was measured on (`version`, `key`, the machine's identity,
    the thread count), through a temporary file and a rename. `load` gives the stored record, or None
    when there is none or it cannot be read as a JSON object (the caller then measures again; `exists`
    tells the two apart). A record whose fields do not fit is the caller's to judge."""

    def __init__(self, kind: str, device: torch.device, key: dict, version: int):
        self.device, self.key, self.version = device, dict(key), version
        self.path = machine_cache(kind, device, {**self.key, "version": version})

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing, unreadable, not JSON (UnicodeDecodeError is a ValueError)
            return None
        return data if isinstance(data, dict) else None

    def store(self, record: dict) -> None:
        paths.atomic_write_json(self.path, {"version": self.version, **self.key, "machine": machine_identity(self.device),
                                            "threads": torch.get_num_threads(), **record})

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)

