"""`--quant gguf`: a GGUF file's own 4-bit blocks run as viasd's int4, without a float detour.

A model from a `.gguf` file loads through transformers' conversion, every block dequantized
(gguf_files.py); `--quant int4` would then choose new int4 codes and scales from those values.
`--quant gguf` instead packs each linear layer the file stores in a 4-bit block type from the
file's own codes, with one scale and one zero per group of 32 inputs, tinygemm's int4 layout
(weight_formats.int4_from_codes), where a weight is (q - 8) * scale + zero:

- Q4_0 (blocks of 32: fp16 d, w = d * (q - 8)): scale d, zero 0;
- Q4_1 (blocks of 32: fp16 d and m, w = d * q + m): scale d, zero m + 8 d;
- Q4_K (super-blocks of 256: fp16 d and dmin, eight 6-bit scales sc and mins mn, one per 32,
  w = d * sc * q - dmin * mn): scale d * sc, zero 8 d * sc - dmin * mn. Its sub-blocks are the
  groups of 32, so it maps like the others.

The output head, where the file stores it as Q8_0 (blocks of 32: fp16 d, w = d * q, q int8; often the
token embedding, tied), runs on a CPU as the file's own blocks too: int8 codes with one float32 scale
a block (exact), through products that keep the logits in float32 (PackedLinear.grouped,
viasd_kernels' bind_int8g). Re-packed as int8 with one scale a row, as before 2026-12-02, its weights
moved by up to half a row's step, and the logits were rounded to bfloat16: together they cost 0.7
points of agreement with llama.cpp (docs/experiments/gguf-activation-precision.md).

The codes are the file's bits. The scale and the zero are rounded once to bfloat16 (the kernels'
dtype; fp16's 11 significant bits to bfloat16's 8): a weight moves by at most
2^-8 (|q - 8| |scale| + |zero|) from the file's value (Q4_0's zero is 0, exactly), and not at all
where both are bfloat16 numbers already (tests/loading/test_gguf_blocks.py). As at `--quant int4`, the
short passes' kernels apply the scale and zero to each group's float32 sums, and a prefill's dense
product applies each weight rounded to bfloat16. Every other linear layer
(Q8_0 but the head's: the layer calls around them take one scale a row and bfloat16 outputs; Q5_*,
Q6_K, Q2_K, Q3_K: codes of other widths; float tensors) is packed int8 per row from the file's
dequantized values, as the output head is at `--quant int4`.

Rows: llama.cpp's converter permutes the rows of Llama's q and k weights, and transformers undoes
that while loading (its TensorProcessor for the architecture). The same processor is run here on
an array of indices of the tensor's shape: where it only reorders whole rows, the codes' and the
scales' rows are reordered alike (every block lies within one row); where it does anything else
the layer is packed int8 from the loaded values instead. Layers are found by transformers' own map
of GGUF names to parameters, and a tied output head shares its embedding's blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from viasd_core.errors import UsageError

GROUP = 32
NATIVE = ("Q4_0", "Q4_1", "Q4_K")  # block types whose codes are int4 in groups of 32


@dataclass
class BlockReport:
    """What `apply_gguf_blocks` packed: layer name -> block type; and the layers left to int8, why."""
    native: dict[str, str] = field(default_factory=dict)
    others: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        int4 = {k: v for k, v in self.native.items() if v in NATIVE}
        kinds = sorted(set(int4.values()))
        text = f"{len(int4)} layers run the file's {'/'.join(kinds) or 'no'} blocks as int4"
        if heads := [k for k, v in self.native.items() if v == "Q8_0"]:
            text += f", {heads[0]} its Q8_0 blocks as int8 by blocks (float32 logits)"
        if self.others:
            shown = "; ".join(f"{k}: {v}" for k, v in list(self.others.items())[:3])
            more = f"; {len(self.others) - 3} more" if len(self.others) > 3 else ""
            text += f", {len(self.others)} int8 per row ({shown}{more})"
        return text


def gguf_source(ref: str) -> Path:
    """The GGUF file `--quant gguf` reads for model reference `ref` (the embedded model's own file
    for its names); a UsageError for any reference that is not a .gguf file."""
    from viasd_core.loading.gguf_files import is_gguf_path
    from viasd_core.loading.embedded import EMBEDDED_ALIASES, embedded_gguf

    if (ref or "").lower() in EMBEDDED_ALIASES:
        return embedded_gguf()
    if ref and is_gguf_path(ref):
        return Path(ref).expanduser().resolve()
    raise UsageError(f"--quant gguf runs a .gguf file's own blocks, and '{ref}' is not a .gguf file: use --quant int4 or int8")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit codes: each run of 16 bytes holds elements 0..15 in its low nibbles and 16..31 in
    its high ones ([..., bytes] -> [..., 2 * bytes], 0..15)."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, 16)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*qs.shape[:-3], -1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Two bytes a value, little-endian fp16 -> float32 ([..., 2] -> [...])."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def block_codes(data: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor [n, k] stored as `qtype` (one of NATIVE; `data` its bytes, a row each) ->
    (codes [n, k] uint8 0..15, scale [n, k / 32], zero [n, k / 32], float32), each weight
    (q - 8) * scale + zero, tinygemm's form: the value gguf.quants.dequantize computes (products
    and sums of fp16 values and small integers, exact in float32 unless their exponents lie more
    than 13 apart; Q4_K's zero 8 d sc - dmin mn rounded once in float32)."""
    rows = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if qtype == "Q4_0":
        b = rows.reshape(n, k // 32, 18)
        d = _fp16(b[..., 0:2])
        return _nibbles(b[..., 2:]).reshape(n, k), d, np.zeros_like(d)
    if qtype == "Q4_1":
        b = rows.reshape(n, k // 32, 20)
        d, m = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
        return _nibbles(b[..., 4:]).reshape(n, k), d, m + 8 * d
    if qtype == "Q4_K":
        from gguf.quants import Q4_K

        b = rows.reshape(n * (k // 256), 144)
        d, dmin = _fp16(b[:, 0:2])[:, None], _fp16(b[:, 2:4])[:, None]
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        # gguf: qs [.., 4, 32] >> (0, 4): chunk c's low nibbles are sub-block 2c, its high ones 2c + 1
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(n, k)
        scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
        return codes, scale, 8 * scale - (dmin * mn.astype(np.float32)).reshape(n, k // 32)
    raise ValueError(f"{qtype} is not a 4-bit block type in groups of 32")


def q8_0_blocks(data: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A tensor [n, k] stored as Q8_0 (`data` its bytes, a row each; blocks of 32: fp16 d, then 32
    int8 codes) -> (codes [n, k] int8, scales [n, k / 32] float32), each weight d * q exactly."""
    b = np.asarray(data, dtype=np.uint8).reshape(n, k // GROUP, 2 + GROUP)
    return np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k), _fp16(b[..., 0:2])


def _row_order(processor, name: str, n: int, k: int, mapping: dict) -> tuple[np.ndarray | None, str]:
    """The row order transformers' `processor` gives the tensor `name` [n, k] on loading, found by
    processing an array of indices: (order, name it loads as); (None, why) where it does anything
    but reorder whole rows."""
    probe = np.arange(n * k, dtype=np.int64 if n * k >= 2**31 else np.int32).reshape(n, k)
    try:
        result = processor.process(weights=probe, name=name, tensor_key_mapping=mapping,
                                   parsed_parameters={"config": dict(processor.config), "tensors": {}})
    except (KeyError, ValueError, TypeError, IndexError) as e:
        return None, f"transformers' loader does not read it alone ({type(e).__name__})"
    out = result.weights
    if result.name is None or not isinstance(out, np.ndarray) or out.shape != (n, k):
        return None, "transformers' loader reshapes it"
    order = out[:, 0] // k
    if not np.array_equal(out, order[:, None] * k + np.arange(k)) or not np.array_equal(np.sort(order), np.arange(n)):
        return None, "transformers' loader changes it beyond reordering rows"
    return order, result.name


def apply_gguf_blocks(model: torch.nn.Module, path: str | os.PathLike, dtype: torch.dtype) -> BlockReport:
    """Replace, in place, each linear layer of `model` (loaded from the GGUF file `path` by
    transformers, weights in `dtype`) that the file stores in a NATIVE block type by an int4 layer
    over the file's codes (see the module doc). The other layers are left as they are (`--quant
    gguf` then packs them int8: weight_formats._kind), but an output head stored as Q8_0, on a CPU:
    int8 over the file's blocks, one float32 scale a block (see the module doc)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    from viasd_core.runtime.weight_formats import bf16_pays_of, int4_from_codes

    reader = gguf.GGUFReader(str(path))
    arch = (read_field(reader, "general.architecture") or [""])[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)
    linears: dict[int, list[str]] = {}  # a parameter -> the linear layers holding it (a tied head too)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            linears.setdefault(id(module.weight), []).append(name)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    report = BlockReport()
    packed: dict[str, torch.nn.Module] = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        k, n = (int(x) for x in tensor.shape[:2]) if len(tensor.shape) == 2 else (0, 0)
        if qtype == "Q8_0" and head is not None and n and not k % GROUP and head.weight.device.type == "cpu":
            _pack_q8_0_head(model, tensor, n, k, processor, mapping, linears, head, packed, report)
            continue
        if qtype not in NATIVE:
            continue
        if not n or k % (256 if qtype == "Q4_K" else GROUP):
            continue
        order, hf_name = _row_order(processor, tensor.name, n, k, mapping)
        if order is None:
            for layer in _layers(model, mapping.get(tensor.name), linears):
                report.others[layer] = f"{qtype}: {hf_name}"
            continue
        layers = _layers(model, mapping.get(hf_name), linears)
        if not layers:
            continue
        codes, scale, zero = block_codes(tensor.data, qtype, n, k)
        codes, scale, zero = (torch.from_numpy(np.ascontiguousarray(a[order])) for a in (codes, scale, zero))
        for layer in layers:
            module = model.get_submodule(layer)
            if tuple(module.weight.shape) != (n, k):
                report.others[layer] = f"{qtype}: shape {tuple(module.weight.shape)} is not the file's ({n}, {k})"
                continue
            device = module.weight.device
            bias = None if module.bias is None else module.bias.detach().to(dtype)
            packed[layer] = int4_from_codes(codes.to(device), scale.to(device, dtype), zero.to(device, dtype), bias,
                                            bf16_pays=bf16_pays_of(model))
            report.native[layer] = qtype
    for layer, new in packed.items():
        parent, _, child = layer.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    for tensor in reader.tensors:  # what stays for int8, and why
        qtype = tensor.tensor_type.name
        for layer in _layers(model, mapping.get(tensor.name), linears):
            if layer not in report.native and layer not in report.others:
                report.others[layer] = (f"{qtype} (not a 4-bit block type in groups of 32)" if qtype not in NATIVE
                                        else f"{qtype} of another shape")
    return report


def _pack_q8_0_head(model, tensor, n: int, k: int, processor, mapping: dict, linears: dict, head, packed: dict,
                    report: BlockReport) -> None:
    """Where the Q8_0 `tensor` [n, k] is `model`'s output head's weight (its own, or the embedding it
    is tied to), pack that head from the file's blocks (`packed[name]`); else leave it (int8 per row)."""
    from viasd_core.runtime.weight_formats import int8_from_blocks

    order, hf_name = _row_order(processor, tensor.name, n, k, mapping)
    names = [layer for layer in _layers(model, mapping.get(hf_name if order is not None else tensor.name), linears)
             if model.get_submodule(layer) is head]
    if not names:
        return
    if order is None:
        report.others[names[0]] = f"Q8_0: {hf_name}"
        return
    if tuple(head.weight.shape) != (n, k) or head.bias is not None:
        report.others[names[0]] = f"Q8_0: shape {tuple(head.weight.shape)} is not the file's ({n}, {k})"
        return
    codes, scales = (torch.from_numpy(np.ascontiguousarray(a[order])) for a in q8_0_blocks(tensor.data, n, k))
    packed[names[0]] = int8_from_blocks(codes, scales, GROUP)
    report.native[names[0]] = "Q8_0"


def _layers(model: torch.nn.Module, hf_name: str | None, linears: dict[int, list[str]]) -> list[str]:
    """The linear layers whose weight is the parameter `hf_name` of `model` (none where it is not one)."""
    if not hf_name:
        return []
    try:
        param = model.get_parameter(hf_name)
    except AttributeError:
        return []
    return linears.get(id(param), [])
