"""Synthetic benchmark: measured per-step costs on random-weight models of a real shape, and a
PROJECTION of the speedups of sd, exact and viasd from acceptance statistics (docs/algorithm.md section 1).

Nothing here generates text: random weights accept nothing, so the acceptance numbers come from a
real run (`--acceptance-from summary.json`) or from the documented defaults below. The maths are
pure functions (tested with hand-made numbers); `measure_costs` is the only part that runs models.

Model of one speculative step with block length g (every quantity measured or given):

    time_per_step   = g * cost_draft + slim_passes * cost_slim(g + 1) + full_fraction * cost_target(g + 1)
    tokens_per_step = (1 - a^(g + 1)) / (1 - a)          (a = per-token acceptance, i.i.d.)
    speedup         = tokens_per_step * cost_target(1) / time_per_step   (over plain decoding)

With cost_target(g + 1) == cost_target(1), no slim pass and full_fraction = 1 this is docs/algorithm.md's
(1 - a^(g+1)) / (1 - a) / (1 + g * c), c = cost_draft / cost_target.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from viasd_core.errors import UsageError, ViasdError

LABEL = "projection"

# Real sizes (config.json of the public checkpoints); the draft is the usual small model of the family.
SHAPES: dict[str, dict] = {
    "tiny": dict(
        family="llama",
        target=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
        draft=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
        names=("tiny (test shape)", "tiny draft"),
    ),
    "llama-3-8b": dict(
        family="llama",
        target=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
        draft=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                   rope_theta=500000.0),
        names=("meta-llama/Meta-Llama-3-8B (shape)", "meta-llama/Llama-3.2-1B (shape)"),
    ),
    "qwen2.5-7b": dict(
        family="qwen2",
        target=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0),
        draft=dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0),
        names=("Qwen/Qwen2.5-7B-Instruct (shape)", "Qwen/Qwen2.5-0.5B-Instruct (shape)"),
    ),
    "vicuna-7b": dict(
        family="llama",
        target=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        draft=dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                   num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096),
        names=("lmsys/vicuna-7b-v1.3 (shape)", "double7/vicuna-68m (shape)"),
    ),
}

# Used when no --acceptance-from is given. Assumed, not measured: sd ~ a typical same-family
# draft on chat prompts (Spec-Bench SpS ~1.5x); exact = sd (the slim tier only reshapes the block);
# viasd = sd + 0.10 (the paper reports rejection rates 0.10-0.22 lower) with the target called on
# half of the steps.
DEFAULT_ACCEPTANCE = {"sd": 0.70, "exact": 0.70, "viasd": 0.80}
DEFAULT_VIASD_FULL_FRACTION = 0.5
DEFAULT_SKIP_RATIO = 0.45
DEFAULT_CONTEXT = 128  # tokens in the KV caches when the step costs are timed
DEFAULT_REPS = 20  # timed repetitions per cost (the median is kept)
PROJECTED_METHODS = ("sd", "exact", "viasd")


# ---------------------------------------------------------------------- pure maths
def expected_tokens_per_pass(acceptance: float, gamma: int) -> float:
    """Expected tokens emitted per step with i.i.d. per-token acceptance `acceptance` and block `gamma`."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if acceptance >= 1.0:
        return float(gamma + 1)
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


def step_time(gamma: int, cost_draft: float, cost_target_block: float, cost_slim_block: float = 0.0,
              slim_passes: float = 0.0, full_fraction: float = 1.0) -> float:
    """Seconds per speculative step: gamma draft steps, optional slim pass, target pass on a fraction of steps."""
    return gamma * cost_draft + slim_passes * cost_slim_block + full_fraction * cost_target_block


def slim_layer_ids(n_layers: int, skip_ratio: float = DEFAULT_SKIP_RATIO) -> list[int]:
    """Layers a slim verifier keeps: first and last always, `skip_ratio` of the rest skipped evenly."""
    if n_layers < 1:
        raise ValueError("n_layers must be >= 1")
    n_skip = min(max(0, round(n_layers * skip_ratio)), max(0, n_layers - 2))
    if n_skip == 0:
        return list(range(n_layers))
    middle = list(range(1, n_layers - 1))
    step = len(middle) / n_skip
    skipped = {middle[int(i * step + step / 2)] for i in range(n_skip)}
    return [i for i in range(n_layers) if i not in skipped]


@dataclass
class Assumption:
    acceptance: float
    source: str  # 'default (assumed)' or the file it was read from
    full_fraction: float = 1.0
    measured_mean_accepted_length: float | None = None


def acceptance_from_summary(path: str | Path | None) -> dict[str, Assumption]:
    """Per projected method: acceptance (and viasd's fraction of steps that call the target)."""
    out = {m: Assumption(DEFAULT_ACCEPTANCE[m], "default (assumed)",
                         DEFAULT_VIASD_FULL_FRACTION if m == "viasd" else 1.0) for m in PROJECTED_METHODS}
    if path is None:
        return out
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--acceptance-from '{path}' not found: give the summary.json of a `viasd bench --out DIR` run")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"--acceptance-from '{path}' is not JSON: give the summary.json of a `viasd bench --out DIR` run")
    if not isinstance(data, dict) or not isinstance(data.get("methods"), dict):
        raise UsageError(f"--acceptance-from '{path}' has no 'methods' block: give the summary.json of a `viasd bench --out DIR` run")
    if (data.get("meta") or {}).get("label") == LABEL:
        raise UsageError(f"--acceptance-from '{path}' is itself a projection: give the summary.json of a measured run")
    for m in PROJECTED_METHODS:
        row = data["methods"].get(m) or {}
        rate = row.get("acceptance_rate")
        if row.get("status") == "ok" and isinstance(rate, (int, float)) and 0 <= rate <= 1:
            full = 1.0
            if m == "viasd" and isinstance(row.get("target_passes_per_step"), (int, float)):
                full = min(1.0, max(0.0, float(row["target_passes_per_step"])))
            out[m] = Assumption(float(rate), str(p), full, row.get("mean_accepted_length"))
    return out


def project(costs: dict, gamma: int, assumptions: dict[str, Assumption]) -> dict[str, dict]:
    """Projected speedup (and tokens/s) per method from measured costs and acceptance assumptions.

    costs: {"draft_step": s, "slim_block": s, "target": {"1": s, ..., str(gamma + 1): s}}.
    """
    t1 = costs["target"]["1"]
    tb = costs["target"][str(gamma + 1)]
    out = {"ar": {"speedup_vs_ar": 1.0, "tokens_per_s": 1.0 / t1, "tokens_per_step": 1.0, "step_s": t1}}
    for m in PROJECTED_METHODS:
        a = assumptions[m]
        slim = 0.0 if m == "sd" else 1.0
        full = a.full_fraction if m == "viasd" else 1.0
        t = step_time(gamma, costs["draft_step"], tb, costs["slim_block"], slim, full)
        e = expected_tokens_per_pass(a.acceptance, gamma)
        out[m] = {
            "speedup_vs_ar": e * t1 / t,
            "tokens_per_s": e / t,
            "tokens_per_step": e,
            "step_s": t,
            "acceptance": a.acceptance,
            "acceptance_source": a.source,
            "full_fraction": full,
            "slim_passes_per_step": slim,
            "measured_mean_accepted_length": a.measured_mean_accepted_length,
        }
    return out


# ---------------------------------------------------------------------- measurement
def build_random_model(family: str, sizes: dict, dtype, device):
    """A random-weight causal LM of the given sizes (no download, nothing read from disk)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from viasd_core.loading.progress import quiet_transformers

    quiet_transformers()
    cfg = AutoConfig.for_model(family, tie_word_embeddings=False, **sizes)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _median_time(fn, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_costs(target, draft, slim, gamma: int, context: int = 128, reps: int = 20, warmup: int = 3) -> dict:
    """Median seconds of: one draft step, one slim pass over gamma + 1 tokens, target passes over
    1..gamma + 1 tokens, each at position `context` (the caches hold `context` random tokens)."""
    import torch

    device = target.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    vocab = min(target.shape.vocab_size, draft.shape.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (context + gamma + 2,), generator=g).to(device)
    for m in (target, draft, slim):
        m.allocate(context + gamma + 8)
        m.reset()
        m.forward(ids[:context], 0, 1)  # prefill

    def one(model, t):
        def fn():
            model.rollback(context)
            model.forward(ids[context:context + t], context, 1)
        for _ in range(warmup):
            fn()
        return _median_time(fn, reps, sync)

    costs = {"draft_step": one(draft, 1), "slim_block": one(slim, gamma + 1),
             "target": {str(t): one(target, t) for t in range(1, gamma + 2)}}
    costs["context"] = context
    costs["reps"] = reps
    return costs


@dataclass
class SyntheticPlan:
    name: str
    device: str
    dtype: str
    gamma: int
    skip_ratio: float = DEFAULT_SKIP_RATIO
    context: int = field(default_factory=lambda: DEFAULT_CONTEXT)
    reps: int = field(default_factory=lambda: DEFAULT_REPS)
    force: bool = False
    acceptance_from: str | None = None


def check_plan(plan: SyntheticPlan) -> None:
    if plan.name not in SHAPES:
        raise UsageError(f"unknown --synthetic shape '{plan.name}': use one of {', '.join(SHAPES)}")
    if plan.gamma < 1:
        raise UsageError(f"gamma must be at least 1 (got {plan.gamma}): pass --gamma 1 or more")
    if plan.device == "cpu" and plan.name != "tiny" and not plan.force:
        raise UsageError(
            f"--synthetic {plan.name} on CPU would allocate a full-size model (an 8B model in fp32 needs ~32 GB) "
            "and time a CPU nobody serves it on: run it on a GPU, use --synthetic tiny, or pass --force"
        )


def run_synthetic(plan: SyntheticPlan, progress=None) -> dict:
    """Measure costs on random-weight models of the shape and project speedups. Returns the summary."""
    import torch

    from viasd_core.devices import resolve_device, resolve_dtype
    from viasd_core.runtime.model import FastModel

    check_plan(plan)
    assumptions = acceptance_from_summary(plan.acceptance_from)
    device = resolve_device(plan.device)
    dtype = resolve_dtype(plan.dtype, device)
    shape = SHAPES[plan.name]
    log = progress or (lambda msg: None)
    log(f"building random-weight {shape['names'][0]} and {shape['names'][1]} on {device} ({dtype})")
    try:
        target_hf = build_random_model(shape["family"], shape["target"], dtype, device)
        draft_hf = build_random_model(shape["family"], shape["draft"], dtype, device)
    except torch.OutOfMemoryError:
        raise ViasdError(f"out of memory building the {plan.name} shape on {device}: use a larger GPU or --synthetic tiny")
    n_layers = target_hf.config.num_hidden_layers
    kept = slim_layer_ids(n_layers, plan.skip_ratio)
    size = plan.context + plan.gamma + 8
    target = FastModel(target_hf, max_len=size, name="target")
    draft = FastModel(draft_hf, max_len=size, name="draft")
    slim = FastModel(target_hf, layer_ids=kept, max_len=size, name="slim")
    log("measuring step costs")
    costs = measure_costs(target, draft, slim, plan.gamma, plan.context, plan.reps)
    projection = project(costs, plan.gamma, assumptions)
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {
        "label": LABEL,
        "shape": plan.name,
        "target_shape": shape["names"][0],
        "draft_shape": shape["names"][1],
        "target_params": params(target_hf),
        "draft_params": params(draft_hf),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "gamma": plan.gamma,
        "slim_layers": kept,
        "slim_skip_ratio": 1 - len(kept) / n_layers,
        "costs_s": costs,
        "cost_ratio_draft_over_target": costs["draft_step"] / costs["target"]["1"],
        "projection": projection,
        "assumptions": [
            "PROJECTION, not a measurement: random weights, no text is generated.",
            "Per-step costs are measured (median of reps) at a context of "
            f"{plan.context} tokens; batch size 1.",
            "Acceptance is i.i.d. per position: tokens per step = (1 - a^(g+1)) / (1 - a); real acceptance falls with the position.",
            "speedup = tokens_per_step * cost_target(1) / (g * cost_draft + slim * cost_slim(g+1) + full_fraction * cost_target(g+1)).",
            "sd: no slim pass, target every step; exact: one slim pass and the target every step; "
            "viasd: one slim pass, the target on `full_fraction` of the steps (lossy: fidelity is not modelled).",
            "Gamma is fixed (no adaptation); prefill, sampling and host overheads are not modelled.",
            f"Defaults when no --acceptance-from is given (assumed): acceptance {DEFAULT_ACCEPTANCE}, "
            f"viasd full_fraction {DEFAULT_VIASD_FULL_FRACTION}.",
        ],
        "acceptance": {m: asdict(a) for m, a in assumptions.items()},
    }



