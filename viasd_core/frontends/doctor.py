"""`viasd doctor`: what the engine runs on this machine, and whether it runs right here.

For the person with the GPU we do not have: it reports the device, dtype, versions, which models
run compiled and whether CUDA graphs were recorded (counted in inductor's CUDA-graph trees after
the checks ran, not read from the requested mode); then checks, on their machine, that the
compiled pass equals the eager one and that the exact modes (`sd`, `exact`) emit `ar`'s greedy
tokens; then a short speed probe (`ar` vs `sd`). Any failed check makes the report fail.

The checks and how they judge a divergence: doctor_checks.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import torch

from viasd_core import cpu_isa
from viasd_core.bench.files import versions
from viasd_core.devices import device_name
from viasd_core.runtime.kernel_ways import kernels_in_force
from viasd_core.speculation.engine import GenerationConfig
from viasd_core.session import GenerationRequest, Session, resolve_config
from viasd_core.loading.models import auto_candidates, format_loader
from viasd_core.machine.format import time_formats
from viasd_core.machine.tree import CURVE_WIDTHS, shape_for_size
from viasd_core.speculation.stats import RunStats

from viasd_core.frontends.doctor_checks import (FAIL, Check, check_compiled_matches_eager, check_exact_mode,
                                               cuda_graphs_recorded, exactness, promise_words)

@dataclass
class DoctorReport:
    environment: dict
    checks: list[Check] = field(default_factory=list)
    speed: dict | None = None
    tree: dict | None = None  # the --tree auto choice, measured again (speed probe only)
    first_block: dict | None = None  # sd's first block without -g, from that probe: {"gamma", "reason"}
    # the target's verify curve at each format --quant auto chooses between (speed probe only;
    # None where it has no choice): format -> {width: seconds}
    format_curves: dict | None = None
    machine: dict | None = None  # the machine profile's picture once the checks ran (machine/profile.py)

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "environment": self.environment, "checks": [asdict(c) for c in self.checks],
                "speed": self.speed, "tree": self.tree, "first_block": self.first_block,
                "format_curves": self.format_curves, "machine": self.machine}


def environment(session: Session, refresh: bool = False) -> dict:
    """The set-up; `cuda_graphs` is filled in by run_doctor once generations have run. `refresh`
    measures the machine-wide verdicts again (the bfloat16 products) instead of reading the cache.
    What was decided for this machine, and why, is read from the session's machine profile."""
    engine = session.engine
    device = engine.device
    machine = session.machine.resolved
    bf16_products = session.machine.bf16_products(refresh)
    packed = session.machine.packed_way(refresh) if device.type == "cpu" else None
    env = {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(engine.target.dtype).replace("torch.", ""),
        "quantization": session.options.quant,
        "quantization_reason": session.target.format_reason,  # with its "<format>: " (the profile drops it)
        "target": session.target.model_id,
        "draft": session.draft_id,
        "max_context": engine.context_len,
        "compiled": list(engine.compiled_models),
        "cuda_graphs": None,
        "cuda_graphs_recorded": None,
        "compile_seconds": session.compile_seconds,
        "compile_reason": machine["compile"].reason if "compile" in machine else None,
        "threads": torch.get_num_threads(),
        "threads_reason": machine["threads"].reason if "threads" in machine else None,
        "short_passes": machine["short-rows"].reason or None if "short-rows" in machine else None,
        "instruction_set": cpu_isa.in_force()[1] if device.type == "cpu" else None,
        **kernels_in_force(engine.target, str(session.target.format)),
        "cuda_available": torch.cuda.is_available(),
        "bf16_supported": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        "bf16_products": bf16_products,
        "packed_way": packed,  # which way the int8/int4 short-pass products run where two build (machine/packed_way.py)
        "exactness": promise_words(exactness(engine.target)),
        "exactness_reason": exactness(engine.target).why,
        **versions(),
    }
    for name in ("bitsandbytes", "torchao", "triton"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


def format_curves(session: Session) -> dict[str, dict[str, float]] | None:
    """The target's verify curve (seconds of a pass over 1..16 tokens after 128 cached positions, the
    widths --tree auto measures) at each weight format `--quant auto` chooses between for this
    model on this machine, each loaded and timed once; None where auto has no choice to make."""
    opts = session.options
    candidates, why_not = auto_candidates(opts.model, session.engine.device, opts.dtype)
    if why_not:
        return None
    curves = time_formats(format_loader(opts.model, session.engine.device), candidates, session.engine.device,
                          CURVE_WIDTHS, context=128, repeats=5, rounds=1)
    return {str(fmt): {str(w): seconds for w, seconds in curve.items()} for fmt, curve in curves.items()}


def speed_probe(session: Session, prompts_ids: list[list[int]], configs: dict[str, GenerationConfig]) -> dict:
    """Tokens per second of each mode of `configs` (ar, and sd where the session drafts) on the
    prompts, after one warm-up run each, with that mode's config."""
    engine = session.engine
    out = {}
    for mode, config in configs.items():
        engine.reset()
        engine.generate(prompts_ids[0], config)  # warm-up
        total = RunStats(mode=mode)
        for ids in prompts_ids:
            engine.reset()
            total.merge(engine.generate(ids, config).stats)
        out[mode] = {"tokens_per_s": total.tokens_per_s, "tokens_per_target_pass": total.mean_accepted_length,
                     "new_tokens": total.new_tokens}
    engine.reset()
    if "sd" in out and out["ar"]["tokens_per_s"] > 0:
        out["sd_speedup"] = out["sd"]["tokens_per_s"] / out["ar"]["tokens_per_s"]
    return out


def run_doctor(session: Session, prompts_ids: list[list[int]], max_new_tokens: int = 32, speed: bool = True) -> DoctorReport:
    report = DoctorReport(environment(session, refresh=speed))
    probe = [t for ids in prompts_ids for t in ids][:64]
    if len(probe) < 8:
        probe = (probe * 8)[:8]
    report.checks.append(check_compiled_matches_eager(session, probe))
    report.checks.append(check_exact_mode(session, "sd", prompts_ids, max_new_tokens))
    report.checks.append(check_exact_mode(session, "exact", prompts_ids, max_new_tokens))
    report.checks.append(check_exact_mode(session, "sd", prompts_ids, max_new_tokens, shape_for_size(10)))
    if speed:
        # --tree auto's measurements, taken again here (`refresh`; cached for later runs); sd's first
        # block without -g comes from them, and the probe's sd (chains) starts there as `viasd generate` would
        asked = GenerationRequest(max_new_tokens=max_new_tokens, trees=False)
        sd = resolve_config(session, dataclasses.replace(asked, mode="sd"), refresh=True)
        report.tree = session.tree.to_dict()
        report.first_block = session.first_block_record()
        configs = {"ar": resolve_config(session, dataclasses.replace(asked, mode="ar"))}
        if session.engine.drafter is not None:
            configs["sd"] = sd
        report.speed = speed_probe(session, prompts_ids, configs)
        report.format_curves = format_curves(session)
    # Counted now that generations ran: CUDA-graph trees record a graph on a pass's second run.
    recorded = cuda_graphs_recorded(session.engine.device)
    report.environment["cuda_graphs_recorded"] = recorded
    report.environment["cuda_graphs"] = None if recorded is None else recorded > 0
    report.machine = session.machine.picture()
    return report
