"""How closely viasd runs a GGUF file's model to llama.cpp running the same file (issue 50's goal).

    python benchmarks/suites/llama_cpp_agreement.py --gguf FILE.gguf --formats gguf,int4,none --out DIR

For each of the first `--limit` held-out prompts (`docs/results/cpu-prompts.jsonl`, first turn, the
file's chat template as viasd applies it), llama.cpp (llama-cpp-python, same token ids, greedy)
writes `-n` tokens. Then each viasd weight format reads the prompt plus llama.cpp's tokens in one
pass and its greedy choice at every position of that continuation is compared with llama.cpp's
token there: teacher-forced agreement (1.0: viasd would have written the same text token by token).
Two ways to read the continuation (`--passes`, runtime/teacher_forced.py): `short` (default) runs
the prompt but its last token as a prefill and the rest in passes of up to 16 positions, as the
engine does, through the kernels that generate tokens (`ar`'s 1-row passes and `sd`'s verify blocks
compute every row alike: the row-invariance rule), so it scores what viasd writes; `one` reads prompt and continuation in one pass, the prefill's products (on a
CPU whose bfloat16 products pay, the weights widened to bfloat16), which no generated token uses.
`gguf` runs the file's own 4-bit blocks, `int4` re-quantizes the dequantized weights, `none` runs the
dequantized weights in float32. Writes DIR/llama_cpp_agreement.json (temporary file, then rename).
Agreement, not speed: it may run on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from viasd_core.runtime import teacher_forced
from viasd_core.runtime.model import FastModel
from viasd_core.loading.models import load_model
from viasd_core.loading.prompts import encode


def llama_cpp_continuations(gguf: str, prompts: list[list[int]], new: int, threads: int) -> list[list[int]]:
    from llama_cpp import Llama

    llm = Llama(gguf, n_ctx=2048, n_threads=threads, verbose=False, logits_all=False)
    eos = llm.token_eos()
    out = []
    for ids in prompts:
        llm.reset()
        cont = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if tok == eos or len(cont) == new:
                break
            cont.append(tok)
        out.append(cont)
    return out


def agreement(fast: FastModel, prompt: list[int], cont: list[int], passes: str = "short") -> int:
    """Positions of `cont` where `fast`'s greedy choice after prompt + cont[:i] is cont[i]."""
    return sum(a == b for a, b in zip(teacher_forced.choices(fast, prompt, cont, passes), cont))


def continuations(path: Path | None, gguf: str, prompts: list[list[int]], new: int, threads: int) -> list[list[int]]:
    """llama.cpp's continuations, read from `path` where it holds them for these prompts, else
    generated (and written there: a temporary file, then renamed)."""
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved["prompts"] == prompts and saved["max_new_tokens"] == new and saved["gguf"] == Path(gguf).name:
            return saved["continuations"]
    conts = llama_cpp_continuations(gguf, prompts, new, threads)
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gguf": Path(gguf).name, "max_new_tokens": new, "prompts": prompts,
                                   "continuations": conts}))
        tmp.replace(path)
    return conts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--formats", default="gguf,int4,none")
    ap.add_argument("--prompts", default="docs/results/cpu-prompts.jsonl")
    ap.add_argument("--limit", type=int, default=13)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", choices=("short", "one"), default="short",
                    help="how viasd reads the continuation: generation's short passes, or one prefill pass")
    ap.add_argument("--continuations", type=Path, help="llama.cpp's continuations: read from here if saved, else written")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.limit]
    first = load_model(args.gguf, quant="none")
    prompts = [encode(first.tokenizer, r["turns"][0]) for r in rows]
    conts = continuations(args.continuations, args.gguf, prompts, args.max_new_tokens, args.threads)
    result = {"gguf": Path(args.gguf).name, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "passes": args.passes, "llama_cpp_tokens": sum(map(len, conts)), "formats": {}}
    for name in args.formats.split(","):
        loaded = first if name == "none" else load_model(args.gguf, quant=name)
        fast = FastModel(loaded.model, max_len=max(len(p) + len(c) for p, c in zip(prompts, conts)) + 8)
        same = [agreement(fast, p, c, args.passes) for p, c in zip(prompts, conts)]
        total = sum(map(len, conts))
        result["formats"][name] = {"agreement": round(sum(same) / total, 4), "per_prompt": same,
                                   "format_reason": getattr(loaded, "format_reason", None)}
        print(name, result["formats"][name]["agreement"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "llama_cpp_agreement.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "llama_cpp_agreement.json")
    print(json.dumps({k: v for k, v in result.items() if k != "formats"} | {
        "agreement": {k: v["agreement"] for k, v in result["formats"].items()}}))


if __name__ == "__main__":
    main()
