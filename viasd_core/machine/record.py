"""Where this machine's decisions are kept: the machine's identity, one named `Decision` per choice
(its version, its measurement, its explanation) and `MachineRecord`, one stored measurement.

Every record lives in one folder of the user's cache, its name keyed by the machine's identity
(`machine_identity`: the device's name, PyTorch's version and, on a CPU, the instruction set and
its class in force and the usable cores) and by what was measured (the decision's key, its version
and the thread count):

    <cache>/machine/<decision>-<identity digest>-<key digest>.json

A record is written through a temporary file and a rename. Bumping one decision's version names
another file for that decision only: it is measured again, the others are read back.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from viasd_core import paths
from viasd_core.devices import device_name, usable_cores


def machine_identity(device: torch.device) -> dict:
    """What a cached measurement of this machine is keyed by: the device's name, on a CPU the
    instruction set PyTorch's kernels use here (AVX512, AVX2, ...), the class in force and the usable cores, and
    PyTorch's version. A cached choice is measured again when any of them changes."""
    identity = {"device": device_name(device), "torch": torch.__version__}
    if device.type == "cpu":
        from viasd_kernels import instruction_set

        identity["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        # the class viasd's kernels and oneDNN/MKL run (VIASD_MAX_CPU_ISA): ATen's capability does not
        # tell AVX-512 with BF16 from AVX-512 without it, and bfloat16 products pay only with it
        identity["isa_class"] = instruction_set.isa_class()
        identity["cores"] = usable_cores()
    return identity


def _digest(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def machine_key(device: torch.device) -> str:
    """The digest of this machine's identity that names each of its records."""
    return _digest(machine_identity(device))


def machine_records(device: torch.device) -> list[Path]:
    """The files of every decision stored for this machine (any key, version and thread count)."""
    return sorted((paths.cache_dir() / "machine").glob(f"*-{machine_key(device)}-*.json"))


class MachineRecord:
    """One cached measurement of this machine: a JSON file in the machine folder named by `kind`
    (the decision), the machine's identity and a digest of `key`, `version` and the thread count.

    `store` writes the record with what it was measured on (`version`, `key`, the machine's identity,
    the thread count), through a temporary file and a rename. `load` gives the stored record, or None
    when there is none or it cannot be read as a JSON object (the caller then measures again; `exists`
    tells the two apart); `read(parse)` gives what `parse` makes of it, or None where its fields do not
    fit (parse raised KeyError, TypeError, ValueError or StopIteration)."""

    def __init__(self, kind: str, device: torch.device, key: dict, version: int):
        self.device, self.key, self.version = device, dict(key), version
        measured = {**self.key, "version": version, "threads": torch.get_num_threads()}
        self.path = paths.cache_dir() / "machine" / f"{kind}-{machine_key(device)}-{_digest(measured)}.json"

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing, unreadable, not JSON (UnicodeDecodeError is a ValueError)
            return None
        return data if isinstance(data, dict) else None

    def read(self, parse: Callable[[dict], object]):
        """What `parse` makes of the stored record; None where there is none or its fields do not fit."""
        data = self.load()
        if data is None:
            return None
        try:
            return parse(data)
        except (KeyError, TypeError, ValueError, StopIteration):
            return None

    def store(self, record: dict) -> None:
        paths.atomic_write_json(self.path, {"version": self.version, **self.key, "machine": machine_identity(self.device),
                                            "threads": torch.get_num_threads(), **record})

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Decision:
    """One machine decision, as the profile (profile.py) names it.

    `name` is its record's kind and its entry in the profile; `setting` the option it resolves
    ("" where none does); `version` is bumped by hand when what it measures changes (its records then
    name other files and it is measured again; None: never stored, because it is measured every session
    or derived from another decision); `measure` is its measurement; `explain` says in one line what is
    decided and from what."""

    name: str
    setting: str
    version: int | None
    measure: Callable
    explain: str

    @property
    def stored(self) -> bool:
        return self.version is not None

    def record(self, device: torch.device, key: dict) -> MachineRecord:
        """This decision's record for `key` on `device` (at the current thread count)."""
        if self.version is None:
            raise ValueError(f"the '{self.name}' decision is not stored (it has no version)")
        return MachineRecord(self.name, device, key, self.version)

    def stored_or_measured(self, device: torch.device, key: dict, from_json: Callable[[dict], object],
                           measure: Callable[[], object], refresh: bool = False):
        """The stored answer for `key` on `device` (read through `from_json`), or `measure()`'s, stored,
        where there is none or `refresh` asks to measure again."""
        record = self.record(device, key)
        stored = None if refresh else record.read(from_json)
        if stored is not None:
            return stored
        result = measure()
        record.store(result)
        return result
