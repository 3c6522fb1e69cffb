"""What a CUDA machine can tell that the CPU stand-ins cannot, in one short run.

    python3 benchmarks/suites/cuda_check.py --out DIR [--budget 420]

1. exact: tiny random models of each family on the GPU, fp32 and bf16, eager and compiled (CUDA
   graphs): ar against transformers' greedy `generate()`, sd / exact / token trees against ar, and
   int8 / int4 where torchao is installed. Equalities are recorded, not assumed: in bf16 a k-row
   verify and a 1-row pass take different cuBLAS kernels, so sd == ar is a measurement there.
2. syncs: host synchronizations per new token (torch.cuda's sync debug mode counts them) and the
   engine's own device-to-host reads, eager and compiled.
3. speed: random-weight models of real shapes (Llama-3.2-1B, Llama-3-8B) in bf16: `ar` tokens/s of
   viasd eager and compiled against transformers' `generate()`, and the target's pass cost for 1..9
   rows (what a verify costs against one token: the ground speculation stands on).

Each part writes DIR/cuda_check.json as it finishes (a run cut by its time limit keeps what it
measured); `--budget` seconds after the start no new part begins. Random weights: the speeds are
real, the texts are not; acceptance is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from viasd_core.speculation.drafters import ModelDrafter
from viasd_core.speculation.engine import Engine, GenerationConfig
from viasd_core.runtime.model import FastModel
from viasd_core.speculation.tree import TreeShape
from viasd_core.loading.synthetic import SHAPES, build_random_model

NEW = 32
DEV = "cuda"  # --device cpu: a dry run of the script itself (tiny parts only)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
# the families' own knobs at tiny sizes (the same ones tests/conftest.py sets)
EXTRA = {
    "llama": {},
    "qwen3": dict(head_dim=32),
    "gemma2": dict(head_dim=32, hidden_activation="gelu_pytorch_tanh", sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"] * 2, attn_logit_softcapping=5.0,
                   final_logit_softcapping=12.0),
    "phi3": dict(partial_rotary_factor=0.75),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                      mlp_only_layers=[1]),
}


class Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


class Report:
    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.start = out, budget, time.perf_counter()
        self.data: dict = {}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def part(self, name: str, fn) -> None:
        if self.left() <= 0:
            self.data[name] = {"skipped": "budget spent"}
            print(f"[{name}] skipped: budget spent", flush=True)
        else:
            t0 = time.perf_counter()
            try:
                self.data[name] = fn()
            except Exception as exc:  # a broken part is a finding; the next parts still run
                self.data[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            self.data[name + "_seconds"] = round(time.perf_counter() - t0, 1)
        tmp = self.out / "cuda_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out / "cuda_check.json")
        print(f"[{name}] {json.dumps(self.data[name], default=str)[:4000]}", flush=True)


def first_diff(a: list[int], b: list[int]):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def hf_greedy(model, prompt, new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def tiny(family, dtype, n_layers=4, seed=0):
    torch.manual_seed(seed)
    sizes = dict(TINY, num_hidden_layers=n_layers, **EXTRA[family])
    if "layer_types" in sizes:
        sizes["layer_types"] = sizes["layer_types"][:n_layers] if n_layers > 1 else ["full_attention"]
    if family == "qwen3_moe" and n_layers == 1:
        sizes["mlp_only_layers"] = []
    return build_random_model(family, sizes, dtype, DEV)


def engine(target, draft=None, slim_layers=None, max_len=256):
    fast = FastModel(target, max_len=max_len)
    drafter = ModelDrafter(FastModel(draft, max_len=max_len, name="draft"), vocab_size=fast.shape.vocab_size) if draft is not None else None
    slim = FastModel(target, layer_ids=slim_layers, max_len=max_len, name="slim") if slim_layers else None
    return Engine(fast, Tok(), drafter=drafter, slim=slim)


def prompt(seed=0, n=16):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def runs(eng, p):
    out = {"ar": eng.generate(p, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens}
    out["sd"] = eng.generate(p, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4)).tokens
    if eng._slim is not None:
        out["exact"] = eng.generate(p, GenerationConfig(mode="exact", max_new_tokens=NEW, gamma=4)).tokens
    if eng.supports_tree:
        out["tree"] = eng.generate(p, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4, tree=TreeShape(2, 4, 5))).tokens
    return out


COMPILED = {("llama", torch.bfloat16), ("gemma2", torch.float32)}


def check_family(family: str, dtype, compiled: bool) -> dict:
    target = tiny(family, dtype, seed=11)
    draft = tiny(family, dtype, n_layers=1, seed=99)
    eng = engine(target, draft, slim_layers=[0, 2])
    if compiled:
        eng.compile()  # graphs compile as the widths are first met
    res = {"compiled_models": list(eng.compiled_models)}
    for s in range(2):
        p = prompt(s)
        got = runs(eng, p)
        ref = hf_greedy(target, p, NEW)
        res[f"prompt{s}"] = {"ar_vs_transformers": first_diff(got["ar"], ref)} | {
            f"{m}_vs_ar": first_diff(t, got["ar"]) for m, t in got.items() if m != "ar"}
    return res


def part_exact() -> dict:
    out = {}
    for family in EXTRA:
        for dtype in (torch.float32, torch.bfloat16):
            # compiled (CUDA graphs) where it differs most: a few setups, compiling lazily, to fit a lease
            for compiled in (False, True) if (family, dtype) in COMPILED else (False,):
                key = f"{family}/{str(dtype)[6:]}/{'compiled' if compiled else 'eager'}"
                try:
                    out[key] = check_family(family, dtype, compiled)
                except Exception as exc:
                    out[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
                print(f"  {key}: {json.dumps(out[key], default=str)[:600]}", flush=True)
    return out


def part_formats() -> dict:
    from viasd_core.runtime.weight_format import WeightFormat
    from viasd_core.runtime.weight_formats import apply_weight_format

    out = {}
    for name in ("int8", "int4"):
        for compiled in (False, True):
            key = f"{name}/{'compiled' if compiled else 'eager'}"
            try:
                target = tiny("llama", torch.bfloat16, seed=11)
                draft = tiny("llama", torch.bfloat16, n_layers=1, seed=99)
                apply_weight_format(target, WeightFormat.parse(name))
                eng = engine(target, draft, slim_layers=[0, 2])
                if compiled:
                    eng.compile()
                got = runs(eng, prompt(0))
                out[key] = {"compiled_models": list(eng.compiled_models)} | {
                    f"{m}_vs_ar": first_diff(t, got["ar"]) for m, t in got.items() if m != "ar"}
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
            print(f"  {key}: {json.dumps(out[key], default=str)[:600]}", flush=True)
    return out


def count_syncs(eng, p, config) -> dict:
    eng.generate(p, config)  # warm
    eng.reset()
    eng.host_reads = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            gen = eng.generate(p, config)
        finally:
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    return {"new_tokens": len(gen.tokens), "steps": gen.stats.steps, "syncs": len(syncs),
            "syncs_per_step": round(len(syncs) / max(gen.stats.steps, 1), 2), "host_reads": eng.host_reads,
            "first_syncs": sorted(set(s[:160] for s in syncs))[:5]}


def part_syncs() -> dict:
    out = {}
    for compiled in (False, True):
        target = tiny("llama", torch.bfloat16, seed=11)
        draft = tiny("llama", torch.bfloat16, n_layers=1, seed=99)
        eng = engine(target, draft)
        if compiled:
            eng.compile()
        tag = "compiled" if compiled else "eager"
        for mode in ("ar", "sd"):
            out[f"{mode}/{tag}"] = count_syncs(eng, prompt(0), GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=4,
                                                                                 adaptive=False))
    return out


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def pass_costs(fast, p: list[int], rows) -> dict:
    """Median milliseconds of one pass over t new rows after 32 cached positions, per t."""
    costs = {}
    for t in rows:
        ids = torch.tensor(p[32:32 + t], device=DEV)

        def one():
            fast.rollback(32)
            fast.forward(ids, 32, 1)
        fast.reset()
        fast.forward(torch.tensor(p[:32], device=DEV), 0, 1)
        for _ in range(3):
            one()
        costs[t] = round(1e3 * statistics.median(timed(one) for _ in range(15)), 3)
    return costs


def speed_shape(label: str, family: str, sizes: dict, new: int, rep: Report, compile_target: bool) -> dict:
    res: dict = {"shape": label, "dtype": "bfloat16", "new_tokens": new, "prompt_tokens": 64}
    model = build_random_model(family, sizes, torch.bfloat16, DEV)
    res["params"] = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    p = torch.randint(3, sizes["vocab_size"] - 1, (64,), generator=g).tolist()
    hf = lambda: model.generate(torch.tensor([p], device=DEV), max_new_tokens=new, min_new_tokens=new,  # noqa: E731
                                do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf()
        res["transformers_generate_tok_s"] = round(new / timed(hf), 1)
    eng = engine(model, max_len=64 + new + 32)
    cfg = GenerationConfig(mode="ar", max_new_tokens=new)
    eng.generate(p, cfg)
    eng.reset()
    res["viasd_ar_eager_tok_s"] = round(new / timed(lambda: eng.generate(p, cfg)), 1)
    fast = eng.target
    res["eager_pass_ms_by_rows"] = pass_costs(fast, p, range(1, 10))
    if compile_target and rep.left() > 60:
        eng.reset()
        t0 = time.perf_counter()
        eng.compile()
        eng.generate(p, cfg)  # compiles the 1-token graph (the 64-token prefill runs eager)
        res["first_compiled_generate_s"] = round(time.perf_counter() - t0, 1)
        eng.reset()
        res["viasd_ar_compiled_tok_s"] = round(new / timed(lambda: eng.generate(p, cfg)), 1)
        res["compiled_pass_ms_by_rows"] = pass_costs(fast, p, (1, 5))  # widths 1 and 8: a gamma-4 verify
    del eng, fast, model
    torch.cuda.empty_cache()
    return res


def part_more(rep: Report, shape: str = "llama-3-8b", new: int = 128) -> dict:
    """The 8B shape again: int4 weights compiled, a one-layer draft of the target's width (an
    EAGLE-style head's cost), and transformers' static cache compiled (its fastest `generate()`)."""
    from viasd_core.runtime.weight_format import WeightFormat
    from viasd_core.runtime.weight_formats import apply_weight_format

    sizes = SHAPES[shape]["target"]
    res: dict = {"shape": shape, "new_tokens": new, "prompt_tokens": 64}
    g = torch.Generator().manual_seed(0)
    p = torch.randint(3, sizes["vocab_size"] - 1, (64,), generator=g).tolist()
    cfg = GenerationConfig(mode="ar", max_new_tokens=new)
    head = build_random_model("llama", dict(sizes, num_hidden_layers=1), torch.bfloat16, DEV)
    eng = engine(head, max_len=64 + new + 32)
    eng.compile()
    res["one_layer_draft_compiled_pass_ms_by_rows"] = pass_costs(eng.target, p, (1,))
    del eng, head
    model = build_random_model("llama", sizes, torch.bfloat16, DEV)
    t0 = time.perf_counter()
    apply_weight_format(model, WeightFormat.parse("int4"))
    res["int4_pack_s"] = round(time.perf_counter() - t0, 1)
    eng = engine(model, max_len=64 + new + 32)
    eng.generate(p, cfg)
    eng.reset()
    res["int4_ar_eager_tok_s"] = round(new / timed(lambda: eng.generate(p, cfg)), 1)
    eng.compile()
    eng.generate(p, cfg)
    eng.reset()
    res["int4_ar_compiled_tok_s"] = round(new / timed(lambda: eng.generate(p, cfg)), 1)
    res["int4_compiled_pass_ms_by_rows"] = pass_costs(eng.target, p, (1, 5))
    del eng, model
    torch.cuda.empty_cache()
    rep.data["more_partial"] = res
    if rep.left() > 90:
        model = build_random_model("llama", sizes, torch.bfloat16, DEV)
        ids = torch.tensor([p], device=DEV)
        hf = lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,  # noqa: E731
                                    pad_token_id=0, cache_implementation="static")
        with torch.no_grad():
            t0 = time.perf_counter()
            hf()
            res["transformers_static_first_s"] = round(time.perf_counter() - t0, 1)
            hf()
            res["transformers_static_tok_s"] = round(new / timed(hf), 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--parts", default="env,exact,speed8b,speed1b,syncs,formats")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out, args.budget)
    llama8b = SHAPES["llama-3-8b"]
    parts = {
        "env": lambda: {"gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "none", "torch": torch.__version__,
                        "cuda": torch.version.cuda,
                        "transformers": __import__("transformers").__version__, "cpus": os.cpu_count()},
        "exact": part_exact,
        "formats": part_formats,
        "syncs": part_syncs,
        "speed1b": lambda: speed_shape("Llama-3.2-1B (shape)", "llama", llama8b["draft"], 128, rep, True),
        "speed8b": lambda: speed_shape("Llama-3-8B (shape)", "llama", llama8b["target"], 128, rep, True),
        "more": lambda: part_more(rep),
        "moretiny": lambda: part_more(rep, "tiny", 16),
        "speedtiny": lambda: speed_shape("tiny (dry run)", "llama", SHAPES["tiny"]["target"], 16, rep, True),
    }
    for name in args.parts.split(","):
        rep.part(name, parts[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
