"""Markdown tables from `viasd bench` summary.json files, and docs/performance.md from docs/results/.

    python benchmarks/suites/summary_to_md.py out/cpu/bench-default/summary.json [...]
    python benchmarks/suites/summary_to_md.py --performance > docs/performance.md

`--performance` reads the files named in PERFORMANCE and PREFILL below (the latest product runs
per machine kind, copied to docs/results/) and writes one table per machine kind. To refresh it:
run the suite on the machine, copy its summary.json to docs/results/, point the machine kind's
entry here at it, and regenerate. Nothing is computed that the files do not hold.
"""

import json
import sys


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table(path: str) -> str:
    s = json.load(open(path))
    meta = s["meta"]
    lines = [
        f"`{path}`: {meta.get('label')} on {meta.get('device_name', meta.get('device'))}, "
        f"target {meta.get('target', {}).get('id')}, draft {meta.get('draft', {}).get('id')}, "
        f"{meta.get('n_prompts', meta.get('prompts', {}).get('count') if isinstance(meta.get('prompts'), dict) else meta.get('prompts'))} prompts, "
        f"date {meta.get('date')}, torch {meta.get('versions', {}).get('torch', meta.get('torch'))}, "
        f"transformers {meta.get('versions', {}).get('transformers', meta.get('transformers'))}",
        f"command: `{' '.join(meta['command']) if isinstance(meta.get('command'), list) else meta.get('command')}`",
        "",
        "| method | status | tokens/s (mean ± std over prompts) | speedup vs ar | vs hf | tokens / target pass | acceptance | tiers accept/slim/full/bonus | fidelity mean (min) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in s["methods"].items():
        if m["status"] != "ok":
            lines.append(f"| {name} | {m['status']}: {m.get('reason')} | | | | | | | |")
            continue
        sh = m.get("tier_shares")
        tiers = "/".join(f"{sh.get(k, 0):.2f}" for k in ("accept", "slim", "full", "bonus")) if sh else "-"
        lines.append(
            f"| {name} | ok | {fmt(m['tokens_per_s_mean'], '.1f')} ± {fmt(m['tokens_per_s_std'], '.1f')} | "
            f"{fmt(m['speedup_vs_ar'])}x | {fmt(m['speedup_vs_hf'])}x | {fmt(m['mean_accepted_length'])} | "
            f"{fmt(m['acceptance_rate'])} | {tiers} | {fmt(m['fidelity_mean'], '.4f')} ({fmt(m['fidelity_min'], '.3f')}) |"
        )
    return "\n".join(lines)


RESULTS = "docs/results/"

# (machine kind, what it is, [(summary file, the setting in words, the record that reported it)])
PERFORMANCE = [
    ("AMD EPYC (Zen 5), AVX-512 BF16", "2 cores, 24 GiB, torch 2.13.0+cpu, 2 threads", [
        ("cpu-epyc-avx512bf16-bench-session25-layer-front-run2-summary.json", "default (`--quant auto` chose int4), layer front in one C call", "first-block-measured-layer-front"),
        ("cpu-epyc-avx512bf16-bench-session25-layer-front-run1-summary.json", "the same code, with llama.cpp in the run", "first-block-measured-layer-front"),
        ("cpu-epyc-avx512bf16-bench-session25-auto-summary.json", "int4, before the layer-front kernel (the latest run with transformers at int4)", "first-block-measured-layer-front"),
        ("cpu-epyc-avx512bf16-bench-session25-none-summary.json", "float32 (`--quant none`)", "first-block-measured-layer-front"),
    ]),
    ("Intel Xeon (Sapphire Rapids), AVX-512 BF16 + AMX", "2 cores, 24 GiB, torch 2.13.0+cpu, 2 threads", [
        ("cpu-formats-int4-summary.json", "int4 (the default then)", "int8-int4-weight-only"),
        ("cpu-formats-int8-summary.json", "int8", "int8-int4-weight-only"),
        ("cpu-formats-fp32-summary.json", "float32", "int8-int4-weight-only"),
        ("cpu-bench-default-summary.json", "float32, the distilled draft + prompt lookup (the latest run with `exact`)", "default-pair-multi-tier"),
    ]),
    ("AMD EPYC (Zen 3), AVX2 only (no AVX-512, no BF16), 2026-12-02", "2 cores under KVM, 24 GiB, torch 2.13.0+cpu, 2 threads, 13 held-out prompts x 64 tokens; llama.cpp: llama-cpp-python 0.3.36 built by scripts/install_llama_cpp.sh (its AVX2 build on this CPU); `--quant auto` chose int4 here; the first session on this kind (2026-11-26, the code of then) is in [avx2-cpu-bf16-products](experiments/avx2-cpu-bf16-products.md)", [
        ("cpu-epyc-zen3-avx2-20261202-int4-attention8-llamacpp-run0-summary.json", "int4 against llama.cpp on the same GGUF file: the row attention laid out for AVX2's registers, the layer call's own buffers made once (run 0 of 2; run 1: 1.24x)", "avx2-row-attention-layout"),
        ("cpu-epyc-zen3-avx2-20261202-int4-q8-head-llamacpp-run0-summary.json", "the same before that: every product over int8 activations, the int8 output head's too", "avx2-int4-int8-activations"),
        ("cpu-epyc-zen3-avx2-20261202-int4-llamacpp-summary.json", "the same with the output head's float32 products (the int4 layers over int8 activations)", "avx2-int4-int8-activations"),
        ("cpu-epyc-zen3-avx2-20261202-before-int4-llamacpp-summary.json", "int4 against llama.cpp, the code before (9cec5af: float32 products over widened weights)", "avx2-int4-int8-activations"),
        ("cpu-epyc-zen3-avx2-20261202-gguf-llamacpp-summary.json", "`--quant gguf` (the file's own Q4_1 blocks) against llama.cpp, int4 layers over int8 activations", "avx2-int4-int8-activations"),
        ("cpu-epyc-zen3-avx2-20261202-native-fp32-ar-hf-attention8-summary.json", "float32 (`--quant none`) against `generate()`, the row attention laid out for AVX2's registers", "avx2-row-attention-layout"),
        ("cpu-epyc-zen3-avx2-20261202-native-fp32-ar-hf-summary.json", "float32 (`--quant none`) against `generate()`, before that", "avx2-int4-int8-activations"),
    ]),
    ("Intel Xeon (Sapphire Rapids), AVX-512 BF16 + AMX, 2026-12-02", "2 cores under KVM, 24 GiB, torch 2.13.0+cpu, 2 threads, 13 held-out prompts x 64 tokens, nothing else running; llama.cpp: llama-cpp-python 0.3.36 built by scripts/install_llama_cpp.sh for the class of each table (`LLAMA_CPP_ISA`; the build line is in each run's summary from run 2 on); this day the machine ran ~1.6x faster than on 2026-12-01: compare within a run", [
        ("cpu-xeon-spr-20261202-native-packed-way-int4-llamacpp-summary.json", "int4 against llama.cpp's default build (AVX-512 VBMI/VNNI/BF16), the packed products' way timed (packed-way chose the portable one)", "xeon-classes-20261202"),
        ("cpu-xeon-spr-20261202-native-packed-way-default-ar-sd-summary.json", "default (`--quant auto` chose int4), `ar` and `sd`, packed-way chose the portable products", "xeon-classes-20261202"),
        ("cpu-xeon-spr-20261202-native-int4-llamacpp-summary.json", "the same before packed-way (the BF16 pair dot products), run 2 of 2 (run 1: 1.96x)", "xeon-classes-20261202"),
        ("cpu-xeon-spr-20261202-native-gguf-llamacpp-summary.json", "`--quant gguf` (the file's own Q4_1 blocks) against llama.cpp", "xeon-classes-20261202"),
        ("cpu-xeon-spr-20261202-native-default-ar-sd-summary.json", "default, `ar` and `sd`, before packed-way (the BF16 pair dot products)", "xeon-classes-20261202"),
        ("cpu-xeon-spr-20261202-native-fp32-ar-hf-summary.json", "float32 (`--quant none`) against `generate()`", "xeon-classes-20261202"),
    ]),
    ("AVX-512F/VNNI without BF16 (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx512`), 2026-12-02", "2 cores under KVM, 24 GiB, torch 2.13.0+cpu, 2 threads, 13 held-out prompts x 64 tokens, nothing else running; llama.cpp: llama-cpp-python 0.3.36 built by scripts/install_llama_cpp.sh for the class of each table (`LLAMA_CPP_ISA`; the build line is in each run's summary from run 2 on); this day the machine ran ~1.6x faster than on 2026-12-01: compare within a run", [
        ("cpu-xeon-spr-20261202-avx512-int4-llamacpp-own-class-summary.json", "int4 against llama.cpp built for this class (LLAMA_CPP_ISA=avx512), run 2 of 2 (run 1: 1.71x)", "xeon-classes-20261202"),
        ("cpu-xeon-spr-20261202-avx512-fp32-ar-hf-summary.json", "float32 (`--quant none`) against `generate()`", "xeon-classes-20261202"),
    ]),
    ("AVX2+FMA (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx2`), 2026-12-02", "2 cores under KVM, 24 GiB, torch 2.13.0+cpu, 2 threads, 13 held-out prompts x 64 tokens, nothing else running; llama.cpp: llama-cpp-python 0.3.36 built by scripts/install_llama_cpp.sh for the class of each table (`LLAMA_CPP_ISA`; the build line is in each run's summary from run 2 on); this day the machine ran ~1.6x faster than on 2026-12-01: compare within a run; the native AVX2 EPYC's figures (a 32 MiB L3: 1.22-1.24x) are in its own table: the cap runs this class's instructions with this Xeon's cache", [
        ("cpu-xeon-spr-20261202-avx2-int4-llamacpp-own-class-summary.json", "int4 against llama.cpp built for this class (LLAMA_CPP_ISA=avx2), run 2 of 2 (run 1: 1.75x)", "xeon-classes-20261202"),
        ("cpu-xeon-spr-20261202-avx2-fp32-ar-hf-summary.json", "float32 (`--quant none`) against `generate()`", "xeon-classes-20261202"),
    ]),
    ("Intel Xeon (Sapphire Rapids), AVX-512 BF16 + AMX, 2026-11-28", "2 cores, 24 GiB, torch 2.13.0+cpu, 2 threads; 13 held-out prompts x 64 tokens (session 28's runs, nothing else running) and 8 prompts x 48 tokens (the first row); llama.cpp: llama-cpp-python 0.3.36 built by scripts/install_llama_cpp.sh (AVX-512 VBMI/VNNI/BF16, no AMX), the same build in every class's row (the cap applies to viasd, not to llama.cpp)", [
        ("cpu-xeon-spr-cap-native-fp32-ar-hf-summary.json", "float32 (`--quant none`), the machine's own class", "instruction-set-classes-capped"),
        ("cpu-xeon-spr-20261128-native-fp32-ar-hf-summary.json", "float32 (`--quant none`), 13 x 64", "llama-cpp-baseline-xeon"),
        ("cpu-xeon-spr-20261128-native-default-ar-sd-summary.json", "default (`--quant auto` chose int4), 13 x 64", "llama-cpp-baseline-xeon"),
        ("cpu-xeon-spr-20261128-native-int4-llamacpp-summary.json", "int4 against llama.cpp on the same GGUF file, 13 x 64", "llama-cpp-baseline-xeon"),
        ("cpu-xeon-spr-20261201-native-int4-llamacpp-own-class-summary.json", "int4 against llama.cpp's default build (this class), 13 x 64, 2026-12-01 (a slower day)", "own-class-llama-cpp-and-before-after"),
        ("cpu-xeon-spr-20261128-native-gguf-llamacpp-summary.json", "`--quant gguf` (the file's own Q4_1 blocks) against llama.cpp, 13 x 64", "llama-cpp-baseline-xeon"),
    ]),
    ("AVX-512F/VNNI without BF16 (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx512`)", "2 cores, 24 GiB, torch 2.13.0+cpu, 2 threads, 8 prompts x 48 tokens (fp32) and 13 x 64 (int4); no native machine of this kind measured; llama.cpp: llama-cpp-python 0.3.36 built by scripts/install_llama_cpp.sh (AVX-512 VBMI/VNNI/BF16, no AMX), the same build in every class's row (the cap applies to viasd, not to llama.cpp)", [
        ("cpu-xeon-spr-cap-avx512-fp32-ar-hf-summary.json", "float32 (`--quant none`)", "instruction-set-classes-capped"),
        ("cpu-xeon-spr-20261128-avx512-int4-llamacpp-summary.json", "int4 against llama.cpp, 13 x 64", "llama-cpp-baseline-xeon"),
        ("cpu-xeon-spr-20261201-avx512-int4-llamacpp-own-class-summary.json", "int4 against llama.cpp built for this class (LLAMA_CPP_ISA=avx512), 13 x 64, 2026-12-01 (a slower day)", "own-class-llama-cpp-and-before-after"),
    ]),
    ("AVX2+FMA (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx2`)", "2 cores, 24 GiB, torch 2.13.0+cpu, 2 threads, 8 prompts x 48 tokens (fp32) and 13 x 64 (int4); the native AVX2 EPYC's figures are in its own table above; llama.cpp: llama-cpp-python 0.3.36 built by scripts/install_llama_cpp.sh (AVX-512 VBMI/VNNI/BF16, no AMX), the same build in every class's row (the cap applies to viasd, not to llama.cpp) (an AVX2-only llama.cpp build was not measured)", [
        ("cpu-xeon-spr-cap-avx2-fp32-ar-hf-summary.json", "float32 (`--quant none`)", "instruction-set-classes-capped"),
        ("cpu-xeon-spr-20261128-avx2-int4-llamacpp-summary.json", "int4 against llama.cpp, 13 x 64", "llama-cpp-baseline-xeon"),
        ("cpu-xeon-spr-20261201-avx2-int4-llamacpp-own-class-summary.json", "int4 against llama.cpp built for this class (LLAMA_CPP_ISA=avx2), 13 x 64, 2026-12-01 (a slower day)", "own-class-llama-cpp-and-before-after"),
    ]),
]

# GPU runs of benchmarks/suites/cuda_check.py: (machine kind, files, record). Random weights of real
# shapes: the speeds are real, acceptance is not measured there.
GPU = [
    ("NVIDIA H200, 2026-11-28", ["cuda-h200-20261128/cuda_check.json", "cuda-h200-20261128/cuda_check_more.json"],
     "cuda-h200-first-run"),
]

# (machine kind, prefill file, record)
PREFILL = [
    ("AMD EPYC (Zen 5), AVX-512 BF16", "cpu-epyc-avx512bf16-prefill-packed.json", "fp32-onednn-packed-on-policy-head"),
    ("AMD EPYC (Zen 3), AVX2 only (no AVX-512, no BF16), 2026-12-02", "cpu-epyc-zen3-avx2-20261202-prefill-768-after.json", "avx2-int4-int8-activations"),
    ("Intel Xeon (Sapphire Rapids), AVX-512 BF16 + AMX, 2026-12-02", "cpu-xeon-spr-20261202-native-prefill-768.json", "xeon-classes-20261202"),
    ("AVX-512F/VNNI without BF16 (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx512`), 2026-12-02", "cpu-xeon-spr-20261202-avx512-prefill-768.json", "xeon-classes-20261202"),
    ("AVX2+FMA (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx2`), 2026-12-02", "cpu-xeon-spr-20261202-avx2-prefill-768.json", "xeon-classes-20261202"),
    ("Intel Xeon (Sapphire Rapids), AVX-512 BF16 + AMX, 2026-11-28", "cpu-xeon-spr-cap-native-prefill-768.json", "instruction-set-classes-capped"),
    ("AVX-512F/VNNI without BF16 (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx512`)", "cpu-xeon-spr-cap-avx512-prefill-768.json", "instruction-set-classes-capped"),
    ("AVX2+FMA (emulated: the Sapphire Rapids Xeon under `VIASD_MAX_CPU_ISA=avx2`)", "cpu-xeon-spr-cap-avx2-prefill-768.json", "instruction-set-classes-capped"),
]


def _cmd(meta):
    c = meta.get("command")
    if isinstance(c, str) and c.startswith("["):
        try:
            c = __import__("ast").literal_eval(c)
        except (ValueError, SyntaxError):
            pass
    if isinstance(c, list):
        args = [a for a in c[1:] if a]
        if "--out" in args:  # the output folder was a scratch path on that machine
            i = args.index("--out")
            args = args[:i] + args[i + 2:]
        c = "viasd " + " ".join(args)
    return c


def performance() -> str:
    out = [
        "# Performance: how fast viasd is today, by machine kind",
        "",
        "Generated by `python benchmarks/suites/summary_to_md.py --performance > docs/performance.md` from",
        "the `viasd bench` summaries in `docs/results/` that the script's PERFORMANCE list names (the latest",
        "product run per machine kind and setting). Do not edit by hand: point the list at a newer run",
        "and regenerate. Every row is one method of one run; `x ar`, `x generate()` and `x llama.cpp` are",
        "against the baselines measured **in the same run** (same process, prompts and seeds); a blank",
        "means that baseline was not in that run. Target: SmolLM2-135M-Instruct (the embedded target),",
        "greedy, 26 held-out Spec-Bench prompts (`docs/results/cpu-prompts.jsonl`). tok/s is the mean",
        "over prompts of new tokens / wall time of the whole call, prefill included. tau: tokens per",
        "target pass. Between two runs of the same code these figures move by up to ~10% on these shared",
        "2-core machines. How each was reached, and what was tried and not kept: `docs/experiments/`.",
        "",
    ]
    for kind, what, runs in PERFORMANCE:
        out += [f"## {kind}", "", what + ".", ""]
        if not runs:
            out += ["Not measured.", ""]
            continue
        out += ["| setting | format | method | tok/s | x ar | x generate() | x llama.cpp | tau | TTFT ms | date | draft | record |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        cmds, seen = [], set()
        for fname, setting, record in runs:
            s = json.load(open(RESULTS + fname))
            meta, ms = s["meta"], s["methods"]
            ok = {k: v for k, v in ms.items() if v["status"] == "ok"}
            seen |= set(ok)
            hf = ok.get("hf", {}).get("tokens_per_s_mean")
            lc = ok.get("llama.cpp", {}).get("tokens_per_s_mean")
            for name, m in ms.items():
                if name in ("hf", "llama.cpp") or m["status"] != "ok":
                    continue
                tps = m["tokens_per_s_mean"]
                ttft = m.get("ttft_s_mean")
                out.append(
                    f"| {setting} | {meta.get('quant')} | `{name}` | {tps:.1f} | {fmt(m.get('speedup_vs_ar'))} | "
                    f"{fmt(tps / hf if hf else None)} | {fmt(tps / lc if lc else None)} | {fmt(m.get('mean_accepted_length'))} | "
                    f"{fmt(ttft * 1000 if ttft else None, '.0f')} | {meta.get('date', '')[:10]} | {meta.get('draft', {}).get('id')} | "
                    f"[{record}](experiments/{record}.md) |")
            base = ", ".join(f"`{k}` {v['tokens_per_s_mean']:.1f} tok/s" for k, v in ok.items() if k in ("ar", "hf", "llama.cpp"))
            skipped = "; ".join(f"`{k}` {v['status']}" for k, v in ms.items() if v["status"] != "ok")
            build = ok.get("llama.cpp", {}).get("build")  # recorded by runs since 2026-12-02
            cmds.append(f"- `{RESULTS}{fname}` ({meta.get('device_name')}, {meta.get('n_prompts')} prompts, "
                        f"{meta.get('max_new_tokens')} new tokens, torch {meta.get('torch')}): `{_cmd(meta)}`; "
                        f"same-run baselines: {base}" + (f"; {skipped}" if skipped else "")
                        + (f"; llama.cpp's build: `{build}`" if build else "")
                        + (f"; instruction set: {meta['instruction_set']}" if meta.get("instruction_set") else "")
                        + (f"; int products: {meta['packed_way']}" if meta.get("packed_way") else ""))
        missing = [f"`{k}`" for k in ("ar", "sd", "exact", "hf", "llama.cpp") if k not in seen]
        out += ["", "Not measured in these runs: " + (", ".join(missing) if missing else "-") + " (`hf` is transformers' `generate()`).",
                "", "Runs:", ""] + cmds + [""]
        pre = [p for p in PREFILL if p[0] == kind]
        for _, fname, record in pre:
            p = json.load(open(RESULTS + fname))
            out += [f"Prefill, {p['tokens']} tokens, {p['threads']} threads, median of {p['repeats']} "
                    f"(`{RESULTS}{fname}`, `benchmarks/suites/prefill.py`, [{record}](experiments/{record}.md)):", "",
                    "| path | ms | tokens/s | x transformers fp32 (same run) |", "| --- | --- | --- | --- |"]
            for k, v in p["ms"].items():
                out.append(f"| {k} | {v:,.0f} | {p['tokens_per_s'][k]} | {fmt(p['x_transformers'][k])} |")
            out.append("")
        if not pre:
            out += ["Prefill: no prefill run of this machine kind in docs/results/ (TTFT above where the run measured it).", ""]
    for kind, files, record in GPU:
        out += gpu_section(kind, files, record)
    return "\n".join(out).rstrip() + "\n"


def gpu_section(kind: str, files: list[str], record: str) -> list[str]:
    """`ar` tokens/s on a GPU from cuda_check.py's JSON files: viasd eager and compiled (CUDA graphs)
    against transformers' `generate()` (default cache, and static cache compiled) of the same run."""
    runs = [json.load(open(RESULTS + f)) for f in files]
    env = runs[0]["env"]
    out = [f"## {kind}", "", f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}; random weights of "
           "real shapes, bfloat16, batch 1, greedy `ar`, 64-token prompt, 128 new tokens (`benchmarks/suites/cuda_check.py`, "
           f"[{record}](experiments/{record}.md)). Speculation's acceptance is not measured on a GPU (no real model "
           "could be carried to it); the pass costs below are what it would stand on.", "",
           "| shape | weights | method | tok/s | x generate() | x generate() static+compiled |", "| --- | --- | --- | --- | --- | --- |"]
    static = {}
    for r in runs:
        more = r.get("more") or {}
        if "transformers_static_tok_s" in more:
            static[more["shape"]] = more["transformers_static_tok_s"]
    names = {"Llama-3-8B (shape)": "llama-3-8b", "Llama-3.2-1B (shape)": "llama-3.2-1b"}
    rows = []
    for r in runs:
        for key in ("speed8b", "speed1b"):
            sp = r.get(key)
            if not sp or "shape" not in sp:
                continue
            hf, st = sp["transformers_generate_tok_s"], static.get(names[sp["shape"]])
            rows.append((sp["shape"], "bf16", "transformers `generate()`", hf, hf, st))
            if st:
                rows.append((sp["shape"], "bf16", "transformers `generate()`, static cache, compiled", st, hf, st))
            rows.append((sp["shape"], "bf16", "viasd `ar` eager", sp["viasd_ar_eager_tok_s"], hf, st))
            if "viasd_ar_compiled_tok_s" in sp:
                rows.append((sp["shape"], "bf16", "viasd `ar` compiled", sp["viasd_ar_compiled_tok_s"], hf, st))
        more = r.get("more") or {}
        if "int4_ar_compiled_tok_s" in more:
            hf8 = next((x["transformers_generate_tok_s"] for x in (q.get("speed8b") for q in runs) if x and "shape" in x), None)
            rows.append(("Llama-3-8B (shape)", "int4", "viasd `ar` eager", more["int4_ar_eager_tok_s"], hf8, static.get("llama-3-8b")))
            rows.append(("Llama-3-8B (shape)", "int4", "viasd `ar` compiled", more["int4_ar_compiled_tok_s"], hf8, static.get("llama-3-8b")))
    for shape, w, method, tps, hf, st in rows:
        out.append(f"| {shape} | {w} | {method} | {tps:.1f} | {fmt(tps / hf if hf else None)} | {fmt(tps / st if st else None)} |")
    out += ["", "Pass cost, ms, compiled, after 32 cached positions (rows: new tokens in the pass; 5 rows = a gamma-4 verify):", "",
            "| shape | weights | 1 row | 5 rows | 5 rows / 1 row |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        for key in ("speed8b", "speed1b"):
            sp = r.get(key) or {}
            c = sp.get("compiled_pass_ms_by_rows")
            if c:
                out.append(f"| {sp['shape']} | bf16 | {c['1']} | {c['5']} | {c['5'] / c['1']:.2f} |")
        more = r.get("more") or {}
        c = more.get("int4_compiled_pass_ms_by_rows")
        if c:
            out.append(f"| Llama-3-8B (shape) | int4 | {c['1']} | {c['5']} | {c['5'] / c['1']:.2f} |")
        if "one_layer_draft_compiled_pass_ms_by_rows" in more:
            out += ["", f"A one-layer draft of the 8B's width with its full output head (an EAGLE-style head's cost): "
                    f"{more['one_layer_draft_compiled_pass_ms_by_rows']['1']} ms a step, compiled."]
    syncs = next((r["syncs"] for r in runs if isinstance(r.get("syncs"), dict) and "ar/compiled" in r["syncs"]), None)
    if syncs:
        out += ["", "Host synchronizations a step (torch.cuda's sync debug mode, tiny model, bf16): " +
                ", ".join(f"{k} {v['syncs_per_step']}" for k, v in syncs.items()) + " (the one token read a step)."]
    return out + [""]


if __name__ == "__main__":
    if sys.argv[1:] == ["--performance"]:
        sys.stdout.write(performance())
    else:
        print("\n\n".join(table(p) for p in sys.argv[1:]))
