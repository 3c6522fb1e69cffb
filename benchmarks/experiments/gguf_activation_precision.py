"""Where `--quant gguf` loses tokens to llama.cpp: the activations' precision or the weights' scales.

    python benchmarks/suites/llama_cpp_agreement.py --gguf FILE.gguf --formats gguf --continuations CONTS.json --out DIR
    python benchmarks/experiments/gguf_activation_precision.py --gguf FILE.gguf --continuations CONTS.json --out DIR

The first command writes llama.cpp's greedy continuations of the held-out prompts (CONTS.json);
this one reads them teacher-forced, in one pass through transformers' forward, with the model's
products computed five ways, and counts the positions where the greedy choice is llama.cpp's token:

    bf16              `--quant gguf` as it runs: activations, residual stream and products in bfloat16
    fp32-stream       the residual stream, norms and attention in float32; each product as today
                      (input rounded to bfloat16, output rounded to bfloat16), added in float32
    fp32-stream-out   as fp32-stream, the product's output kept in float32 (llama.cpp's shape: only
                      a product's input is rounded, to 8 bits per block there)
    fp32-all          everything in float32 over the same weights as `gguf` holds them (the file's
                      codes, its block scales and mins rounded to bfloat16 by the int4 layout)
    none              `--quant none`: transformers' float32 dequantization of the file (scales and
                      mins as the file stores them, float16)

An experiment, not a product path: the products here are PyTorch's operators over the weights as
PackedLinear.widened applies them, not viasd's kernels. Writes DIR/gguf_activation_precision.json
(a temporary file, then renamed).
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import torch

from viasd_core.loading.models import load_model
from viasd_core.runtime.packed_linear import PackedLinear

WAYS = ("bf16", "fp32-stream", "fp32-stream-out", "fp32-all", "none")


def product(way: str, weight: torch.Tensor):
    """A packed layer's forward for `way`, over its weight as the kernel applies it (float32 values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        if way == "fp32-all":
            return torch.nn.functional.linear(x.float(), weight, bias)
        rounded = x.to(torch.bfloat16)
        if way == "fp32-stream":
            y = torch.nn.functional.linear(rounded, weight.to(torch.bfloat16))
            return y.float() + (0 if bias is None else bias)
        return torch.nn.functional.linear(rounded.float(), weight, bias)  # fp32-stream-out

    return forward


def model_for(gguf: str, way: str) -> torch.nn.Module:
    model = load_model(gguf, quant="none" if way == "none" else "gguf", with_tokenizer=False).model
    if way in ("bf16", "none"):
        return model
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.forward = types.MethodType(product(way, module.widened(torch.float32)), module)
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point():
                setattr(module, name, torch.nn.Parameter(p.detach().float(), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_floating_point():
                module._buffers[name] = b.float()
    return model


def agreement(model: torch.nn.Module, prompts: list[list[int]], conts: list[list[int]]) -> list[int]:
    same = []
    with torch.inference_mode():
        for prompt, cont in zip(prompts, conts):
            logits = model(torch.tensor([prompt + cont[:-1]])).logits[0, len(prompt) - 1 :]
            same.append(sum(a == b for a, b in zip(logits.argmax(-1).tolist(), cont)))
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--continuations", type=Path, required=True, help="llama_cpp_agreement.py's saved continuations")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    saved = json.loads(args.continuations.read_text())
    prompts, conts = saved["prompts"], saved["continuations"]
    total = sum(map(len, conts))
    result = {"gguf": Path(args.gguf).name, "prompts": len(prompts), "llama_cpp_tokens": total, "ways": {}}
    for way in args.ways.split(","):
        same = agreement(model_for(args.gguf, way), prompts, conts)
        result["ways"][way] = {"agreement": round(sum(same) / total, 4), "same": sum(same), "per_prompt": same}
        print(way, sum(same), total, result["ways"][way]["agreement"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "gguf_activation_precision.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "gguf_activation_precision.json")


if __name__ == "__main__":
    main()
