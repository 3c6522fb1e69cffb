"""`viasd doctor`: what the engine runs on this machine, and whether it runs right here.

For the person with the GPU we do not have: it reports the device, dtype, versions and whether
compiled graphs / CUDA graphs are active; then checks, on their machine, that the compiled pass
equals the eager one and that the exact modes (`sd`, `exact`) emit exactly `ar`'s greedy tokens;
then a short speed probe (`ar` vs `sd`). Any failed check makes the report fail.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from viasd_core.bench.files import device_name, versions
from viasd_core.decoding.engine import GenerationConfig
from viasd_core.decoding.model import FastModel
from viasd_core.session import Session
from viasd_core.decoding.slim_view import SlimView, slim_verifier
from viasd_core.decoding.stats import RunStats

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    name: str
    status: str  # pass / fail / skip
    detail: str


@dataclass
class DoctorReport:
    environment: dict
    checks: list[Check] = field(default_factory=list)
    speed: dict | None = None

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "environment": self.environment, "checks": [asdict(c) for c in self.checks],
                "speed": self.speed}


def environment(session: Session) -> dict:
    engine = session.engine
    device = engine.device
    cuda_graphs = engine.compiled and device.type == "cuda" and any(
        m.compile_mode == "reduce-overhead" for m in engine.all_models() if m.compiled)
    env = {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(engine.target.dtype).replace("torch.", ""),
        "quantization": session.options.quant,
        "target": session.target.model_id,
        "draft": session.draft_id,
        "max_context": engine.context_len,
        "compiled": engine.compiled,
        "cuda_graphs": cuda_graphs,
        "compile_seconds": session.compile_seconds,
        "cuda_available": torch.cuda.is_available(),
        "bf16_supported": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        **versions(),
    }
    for name in ("bitsandbytes", "torchao", "triton"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


def tolerance(dtype: torch.dtype) -> float:
    """Largest logit difference between two kernels' roundings that is still 'the same pass'."""
    return 1e-3 if dtype == torch.float32 else 5e-2


@torch.inference_mode()
def check_compiled_matches_eager(session: Session, probe_ids: list[int]) -> Check:
    """The compiled target pass against the same pass run eagerly, on prefill, steps and a block."""
    engine = session.engine
    if not engine.compiled:
        return Check("compiled == eager", SKIP, "not compiled (eager path): nothing to compare")
    target = engine.target
    eager = FastModel(target.hf_model, max_len=len(probe_ids) + 16, name="eager")
    eager.vocab_limit = target.vocab_limit
    ids = torch.tensor(probe_ids, dtype=torch.long, device=engine.device)
    n = len(probe_ids) - 6
    engine.reset()
    worst = 0.0
    for start, length in ((0, n), (n, 1), (n + 1, 1), (n + 2, 4)):
        rows = length if start else 1
        want = eager.forward(ids[start : start + length], start, rows)
        got = target.forward(ids[start : start + length], start, rows)
        finite = torch.isfinite(want)
        worst = max(worst, float((got[finite] - want[finite]).abs().max()))
    engine.reset()
    limit = tolerance(target.dtype)
    status = PASS if worst <= limit else FAIL
    return Check("compiled == eager", status, f"largest logit difference {worst:.2e} (limit {limit:.0e})")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_exact_mode(session: Session, mode: str, prompts_ids: list[list[int]], max_new_tokens: int) -> Check:
    """`mode` must emit exactly ar's greedy tokens on every prompt."""
    engine = session.engine
    name = f"{mode} == ar (greedy)"
    if engine.drafter is None:
        return Check(name, SKIP, "no draft (--draft none)")
    own_slim = engine.slim
    if mode == "exact" and own_slim is None:
        # exactness does not depend on which layers the slim keeps: the first half and the last
        n_layers = engine.target.shape.n_layers
        engine.slim = slim_verifier(engine.target, SlimView(tuple(sorted(set(range(n_layers // 2)) | {n_layers - 1}))))
    try:
        for i, ids in enumerate(prompts_ids):
            engine.reset()
            ar = engine.generate(ids, GenerationConfig(mode="ar", max_new_tokens=max_new_tokens)).tokens
            engine.reset()
            got = engine.generate(ids, GenerationConfig(mode=mode, max_new_tokens=max_new_tokens)).tokens
            where = _first_difference(ar, got)
            if where is not None:
                return Check(name, FAIL, f"prompt {i + 1}: differs from ar at new token {where}")
    finally:
        engine.slim = own_slim
        engine.reset()
    return Check(name, PASS, f"{len(prompts_ids)} prompts x {max_new_tokens} tokens identical")


def speed_probe(session: Session, prompts_ids: list[list[int]], max_new_tokens: int) -> dict:
    """Tokens per second of ar and sd on the prompts (after one warm-up run each)."""
    engine = session.engine
    out = {}
    for mode in ("ar", "sd") if engine.drafter is not None else ("ar",):
        config = GenerationConfig(mode=mode, max_new_tokens=max_new_tokens)
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
    report = DoctorReport(environment(session))
    probe = [t for ids in prompts_ids for t in ids][:64]
    if len(probe) < 8:
        probe = (probe * 8)[:8]
    report.checks.append(check_compiled_matches_eager(session, probe))
    report.checks.append(check_exact_mode(session, "sd", prompts_ids, max_new_tokens))
    report.checks.append(check_exact_mode(session, "exact", prompts_ids, max_new_tokens))
    if speed:
        report.speed = speed_probe(session, prompts_ids, max_new_tokens)
    return report
