"""The files and the description of a `viasd bench` run: `results.jsonl`, `summary.json` (both
written atomically, NaN/inf as null), the plots, and the meta block (date, command, device,
versions, models) that makes a measurement traceable.

--out is checked before the run (check_out); a write that still fails at the end (the disk fills,
the folder vanishes) puts the files in a new folder of the cache instead, else of the current
folder (paths.write_elsewhere), and says where (OutputsNotWritten): a run is not lost to its last
step."""

from __future__ import annotations

import json
import math
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from viasd_core.bench.harness import BenchConfig, peak_memory_source
from viasd_core import cpu_isa
from viasd_core.bench.plots import PLOTS, write_plots
from viasd_core.devices import device_name
from viasd_core.errors import ViasdError
from viasd_core.runtime import cpu_kernels
from viasd_core.paths import atomic_write_text, check_writable_dir, check_writable_file, write_elsewhere
from viasd_core.session import Session


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        viasd_version = version("viasd")
    except PackageNotFoundError:
        viasd_version = "unknown"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "viasd": viasd_version,
            "python": platform.python_version()}


def make_meta(device: torch.device, label: str = "measurement", command: list[str] | None = None, **extra) -> dict:
    """The meta block; `command`: the command line measured (default: this process's)."""
    return {
        "label": label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": list(sys.argv if command is None else command),
        "device": str(device),
        "device_name": device_name(device),
        # the class viasd's and PyTorch's CPU kernels ran (VIASD_MAX_CPU_ISA's cap, if any, named in it)
        "instruction_set": cpu_isa.in_force()[1] if device.type == "cpu" else None,
        "torch_threads": torch.get_num_threads(),
        **versions(),
        **extra,
    }


def session_meta(session: Session, config: BenchConfig, prompts_source: str | None, n_prompts: int,
                 command: list[str] | None = None) -> dict:
    t = session.target
    profile = session.profile
    return make_meta(
        session.engine.device, command=command,
        target={"id": t.model_id, "path": str(t.path), "revision": t.revision, "quant": t.quant},
        draft={"id": session.draft_id, "path": str(session.draft.path) if session.draft else None,
               "revision": session.draft.revision if session.draft else None,
               "quant": session.draft.quant if session.draft else None},
        quant=session.options.quant,
        draft_quant=session.options.draft_quant,
        dtype=str(session.engine.target.dtype).replace("torch.", ""),
        profile=({"layer_ids": profile.layer_ids, "n_layers": profile.n_layers, "theta_accept": profile.theta_accept,
                  "theta_slim": profile.theta_slim, "theta_confidence": profile.theta_confidence, "budget": profile.budget,
                  "slim_weights": profile.slim_weights}
                 if profile else None),
        methods=list(config.methods), gamma=config.gamma, adaptive=config.adaptive,
        max_new_tokens=config.max_new_tokens, warmup=config.warmup, repeats=config.repeats, seed=config.seed,
        greedy=True, prompts=prompts_source or "shipped default set", n_prompts=n_prompts,
        peak_memory=peak_memory_source(session.engine.device),
        compiled=session.engine.compiled, compile_seconds=session.compile_seconds,
        compile_reason=session.compile.reason if session.compile else None,  # why compiled or not (machine/compile.py)
        max_context=session.engine.context_len,
        tree=None if session.tree is None else session.tree.to_dict(),  # sd-tree's size, why, what it rests on
        # sd's first block where -g was left unset (gamma None), and why
        first_block=session.first_block_record(),
        threads=None if session.threads is None else session.threads.to_dict(),  # every method runs with this count
        # the way its int8/int4 short passes multiplied (machine/packed_way.py), where the target has such layers
        packed_way=(cpu_kernels.packed_mm_way() if session.engine.device.type == "cpu" and session.target.format.packed
                    else None),
    )


def json_safe(x):
    """`x` with every NaN/inf float replaced by None (JSON has no such numbers)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def summary_json(summary: dict) -> str:
    """The text of a summary.json (also what `viasd bench --json` prints)."""
    return json.dumps(json_safe(summary), indent=2) + "\n"


RUN_FILES = ("results.jsonl", "summary.json", *PLOTS)  # what write_outputs puts in --out


def check_out(out_dir: str | Path, files=RUN_FILES) -> Path:
    """--out, before anything runs: a folder that exists or can be created, writable, where none of
    `files` is a folder (paths.check_writable_dir and check_writable_file: UsageError, exit 2)."""
    out = check_writable_dir(out_dir, "--out")
    for name in files:
        check_writable_file(out / name, "--out")
    return out


def write_summary(out_dir: str | Path, summary: dict) -> Path:
    """summary.json under out_dir, written atomically (temporary file, then rename)."""
    path = Path(out_dir) / "summary.json"
    atomic_write_text(path, summary_json(summary))
    return path


def write_outputs(out_dir: str | Path, rows: list[dict], summary: dict) -> list[Path]:
    """results.jsonl, summary.json (each written atomically) and the PNG plots under out_dir;
    returns the paths written."""
    results = Path(out_dir) / "results.jsonl"
    atomic_write_text(results, "".join(json.dumps(json_safe(r)) + "\n" for r in rows))
    return [results, write_summary(out_dir, summary)] + write_plots(Path(out_dir), rows, summary["methods"])


class OutputsNotWritten(ViasdError):
    """The run's files could not be written to --out at the end. `fallback`: the folder they were
    written to instead (None: none could be written; the summary is only what the command prints).
    `summary`: the run's summary, for the command to show before it fails."""

    def __init__(self, message: str, summary: dict, fallback: Path | None):
        super().__init__(message)
        self.summary = summary
        self.fallback = fallback


def write_or_fall_back(out_dir: str | Path, write: Callable[[Path], list[Path]], summary: dict) -> list[Path]:
    """`write(out_dir)`; if it fails (OSError), `write` again into a new folder of the cache, else
    of the current folder (paths.write_elsewhere), and raise OutputsNotWritten naming it: what was
    measured is kept, and the command exits non-zero."""
    try:
        return write(Path(out_dir))
    except OSError as e:
        reason = e.strerror or str(e)
    folder = write_elsewhere(write, "bench")
    if folder is not None:
        raise OutputsNotWritten(f"could not write to --out '{out_dir}' ({reason}): this run's files are in "
                                f"'{folder}' instead", summary, folder)
    raise OutputsNotWritten(f"could not write to --out '{out_dir}' ({reason}), nor to the cache or the current "
                            "folder: the summary JSON is on stdout, the per-run lines are lost", summary, None)
