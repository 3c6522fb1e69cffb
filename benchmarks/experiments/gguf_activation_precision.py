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

and four ways that tell the scales' rounding from the weights' (the ways above apply an int4 weight
as the prefill's widening does, each weight rounded to bfloat16; a short pass's kernel does not round
the weight: it sums x (q - 8) in float32 and applies the group's scale and zero to the sums):

    kernel-bf16       as `bf16`, each int4 layer's weight (q - 8) * scale + zero in float32 over the
                      bfloat16 scales and zeros (what the short passes' kernels apply), the product's
                      output rounded to bfloat16
    exact-bf16        as kernel-bf16 over the file's own weight (`none`'s, float16 scales and mins)
    kernel-fp32-out   as fp32-stream-out over kernel-bf16's weights
    exact-fp32-out    as fp32-stream-out over the file's own weights
    kernel-fp32-all   as fp32-all over kernel-bf16's weights (no rounding of a product's input)

A way with `+head` (kernel-bf16+head, ...) applies the output head as the file stores it (Q8_0's
blocks of 32, dequantized) where `--quant gguf` re-packs it int8 with one scale a row; with
`+logits` the output head's product (its input rounded as the way rounds it) keeps float32 logits.

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
from viasd_core.runtime import packed_cpu
from viasd_core.runtime.packed_linear import PackedLinear

WAYS = ("bf16", "fp32-stream", "fp32-stream-out", "fp32-all", "none",
        "kernel-bf16", "exact-bf16", "kernel-fp32-out", "exact-fp32-out", "kernel-fp32-all",
        "kernel-bf16+head", "kernel-bf16+logits", "kernel-bf16+head+logits", "kernel-fp32-out+head",
        "kernel-fp32-all+head")


def product(way: str, weight: torch.Tensor):
    """A packed layer's forward for `way`, over its weight as the kernel applies it (float32 values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        if way in ("kernel-bf16", "exact-bf16"):
            return torch.nn.functional.linear(x.float(), weight, bias).to(x.dtype)
        if way == "fp32-all":
            return torch.nn.functional.linear(x.float(), weight, bias)
        rounded = x.to(torch.bfloat16)
        if way == "fp32-stream":
            y = torch.nn.functional.linear(rounded, weight.to(torch.bfloat16))
            return y.float() + (0 if bias is None else bias)
        return torch.nn.functional.linear(rounded.float(), weight, bias)  # fp32-stream-out

    return forward


def int4_weight(module: PackedLinear, name: str, exact: torch.nn.Module | None) -> torch.Tensor:
    """An int4 layer's weight in float32, not rounded: the file's own (`exact`, the `none` model) or
    (q - 8) * scale + zero over the layer's bfloat16 scales and zeros."""
    if exact is not None:
        return exact.get_submodule(name).weight.detach().float()
    n, k = module.qdata.shape[0], module.qdata.shape[1] * 2
    return packed_cpu._int4_dense_reference(module.qdata, module.group, module.scale, packed_cpu._int4_cpu_block(n, k))


def model_for(gguf: str, way: str) -> torch.nn.Module:
    model = load_model(gguf, quant="none" if way == "none" else "gguf", with_tokenizer=False).model
    if way in ("bf16", "none"):
        return model
    way, f32_logits = way.removesuffix("+logits"), way.endswith("+logits")
    way, file_head = way.removesuffix("+head"), way.endswith("+head")
    file = load_model(gguf, quant="none", with_tokenizer=False).model if way.startswith("exact") or file_head else None
    exact = file if way.startswith("exact") else None
    base = {"kernel-fp32-out": "fp32-stream-out", "exact-fp32-out": "fp32-stream-out", "kernel-fp32-all": "fp32-all"}.get(way, way)
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            if module.kind == "int8" and file_head:
                weight = file.get_submodule(name).weight.detach().float()
            elif way.startswith(("kernel", "exact")) and module.kind == "int4":
                weight = int4_weight(module, name, exact)
            else:
                weight = module.widened(torch.float32)
            head_way = "fp32-stream-out" if f32_logits and module.kind == "int8" else base
            module.forward = types.MethodType(product(head_way, weight), module)
            continue
        if base in ("kernel-bf16", "exact-bf16"):
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
    ways = args.ways.split(",")
    if unknown := [w for w in ways if w not in WAYS]:
        raise SystemExit(f"unknown way(s) {', '.join(unknown)}: use some of {', '.join(WAYS)}")
    for way in ways:
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
