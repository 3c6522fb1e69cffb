"""How closely viasd runs a GGUF file's model to llama.cpp running the same file (issue 50's goal).

    python benchmarks/suites/llama_cpp_agreement.py --gguf FILE.gguf --formats gguf,int4,none --out DIR

For each of the first `--limit` held-out prompts (`docs/results/cpu-prompts.jsonl`, first turn, the
file's chat template as viasd applies it), llama.cpp (llama-cpp-python, same token ids, greedy)
writes `-n` tokens. Then each viasd weight format reads the prompt plus llama.cpp's tokens in one
pass and its greedy choice at every position of that continuation is compared with llama.cpp's
token there: teacher-forced agreement (1.0: viasd would have written the same text token by token).
`gguf` runs the file's own 4-bit blocks, `int4` re-quantizes the dequantized weights, `none` runs the
dequantized weights in float32. Writes DIR/llama_cpp_agreement.json (temporary file, then rename).
Agreement, not speed: it may run on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from viasd_core.decoding.model import FastModel
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


def agreement(fast: FastModel, prompt: list[int], cont: list[int]) -> int:
    """Positions of `cont` where `fast`'s greedy choice after prompt + cont[:i] is cont[i]."""
    ids = torch.tensor(prompt + cont, device=fast.device)
    fast.reset()
    with torch.inference_mode():
        logits = fast.forward(ids, 0, len(cont) + 1)  # rows for positions len(prompt) - 1 ... end
    choice = logits[: len(cont)].argmax(-1).tolist()
    return sum(a == b for a, b in zip(choice, cont))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--formats", default="gguf,int4,none")
    ap.add_argument("--prompts", default="docs/results/cpu-prompts.jsonl")
    ap.add_argument("--limit", type=int, default=13)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.limit]
    first = load_model(args.gguf, quant="none")
    prompts = [encode(first.tokenizer, r["turns"][0]) for r in rows]
    conts = llama_cpp_continuations(args.gguf, prompts, args.max_new_tokens, args.threads)
    result = {"gguf": Path(args.gguf).name, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "llama_cpp_tokens": sum(map(len, conts)), "formats": {}}
    for name in args.formats.split(","):
        loaded = first if name == "none" else load_model(args.gguf, quant=name)
        fast = FastModel(loaded.model, max_len=max(len(p) + len(c) for p, c in zip(prompts, conts)) + 8)
        same = [agreement(fast, p, c) for p, c in zip(prompts, conts)]
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
