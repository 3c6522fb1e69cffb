"""Weight-only low-bit formats from torchao: `--quant int8` and `--quant int4`.

Decoding one token reads every weight once, so fewer bytes per weight is the direct way to a
faster `ar`. Each `nn.Linear` of the model is replaced in place by a `PackedLinear`; FastModel's
pass calls the same modules, so the target, its slim view (a subset of the same layers) and
transformers' own forward (bench's baselines, fidelity) share one copy of the packed weights.

- `int8`: symmetric int8 per output row for every linear layer, the output head included.
- `int4`: asymmetric int4 in groups of 32 along the input (tinygemm's layout) for the decoder's
  linear layers; the output head in int8 per row. The head is the layer whose rounding moves
  the argmax most: measured on the embedded SmolLM2 (40 Spec-Bench dev prompts, teacher-forced
  agreement with fp32 `ar`), int4 everywhere 0.920, int4 layers with an int8 head 0.980
  (docs/experiments/int8-int4-weight-only.md).

Both run with bfloat16 activations (on CPU tinygemm's int4 kernel is ~10x slower on float32
inputs); embeddings and norms stay in bfloat16. torchao chooses the quantization parameters and
packs the weights; the pass then calls PyTorch's kernels on plain tensors (`PackedLinear`), so
it is fast eagerly and compiles like a float model. On a CPU with AVX-512 BF16 the short passes
(decoding, verify blocks) call viasd_kernels' packed products instead (cpu_packed_mm: a 6-token int4
verify pass of SmolLM2 1.56x a 1-token pass, against 1.81x through PyTorch's kernels; docs/experiments/short-pass-products-read-once.md), over the same packed tensors. int8 on CUDA calls viasd_kernels' int8
matmul instead (a Triton kernel in a custom op, which compiles and which CUDA graphs capture):
the gpt-fast form it replaces, `mm(x, w.to(bf16)) * scale`, widened every weight to a bfloat16
copy at every call, compiled or not (kernels/int8_mm.py says what that costs).

int4 on CUDA: torchao's tile-packed layout pads the weight's input width to a multiple of 1024
(and its output width to a multiple of 8), and the kernel wants the activation just as wide, in
bfloat16, on a GPU of compute capability 8.0 or newer. `PackedLinear` reads the packed width from
the packed scales and pads the activation to it, as torchao's own linear does; an older GPU is
refused when the format is chosen (weight_format.WeightFormat.check_device).

Which format is a value (weight_format.WeightFormat); this module packs the torchao ones into
`PackedLinear` layers (packed_linear.py), which run on a CPU through packed_cpu.py (tinygemm's
layout read back, the dense prefill product, the packed products bound to each layer) and
elsewhere through packed_torch.py (PyTorch's kernels, viasd_kernels' int8 matmul on CUDA).
"""

from __future__ import annotations

import importlib.util

import torch

from viasd_core.runtime.packed_cpu import PACKED_KERNEL, _int4_cpu_block
from viasd_core.runtime.packed_linear import PackedLinear
from viasd_core.runtime.weight_format import PACKED, WeightFormat
from viasd_core.errors import UsageError, ViasdError

FORMATS = tuple(f.name for f in PACKED)  # the names of the formats packed here (slim views' twins)
INT4_GROUP = 32
INT4_CUDA_TILE_IN, INT4_CUDA_TILE_OUT = 1024, 8  # torchao's tile-packed layout pads the weight to these
BF16_PAYS = "viasd_bf16_pays"  # a model's attribute: the machine's bfloat16 verdict, as its loader recorded it


def bf16_pays_of(model: torch.nn.Module) -> bool:
    """Whether bfloat16 products pay where `model` runs (machine/bf16.py), as its loader recorded it on
    the model (loading/models.py); True where none was recorded (a model built by a test or a script).
    The layers packed from `model` take it at load: a CPU prefill's dense product in bfloat16 or float32."""
    return getattr(model, BF16_PAYS, True)


def activation_dtype(fmt: WeightFormat, dtype: str | None, device: torch.device) -> torch.dtype:
    """The activations' dtype for a torchao format: bfloat16 (float16 on a GPU without bf16, for
    int8; int4 refuses such a GPU here, before any weight is read)."""
    fmt.check_device(device)
    want = torch.bfloat16 if device.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
    if dtype is not None and dtype != str(want).removeprefix("torch."):
        raise UsageError(f"--quant {fmt} runs with {str(want).removeprefix('torch.')} activations: drop --dtype {dtype}")
    return want


def int4_packed_shape(out_features: int, in_features: int, device: torch.device) -> tuple[int, int]:
    """(out, in) of an int4 weight as packed on `device`: on CUDA padded to torchao's tile-packed
    layout (`Int4TilePackedTo4dTensor.from_hp`: the input width to a multiple of 1024, the output
    to a multiple of 8); on CPU as it is. Memory estimates use it; the pass reads the packed width
    from the packed data itself (PackedLinear.packed_in)."""
    if device.type != "cuda":
        return out_features, in_features

    def round_up(n: int, m: int) -> int:
        return -(-n // m) * m

    return round_up(out_features, INT4_CUDA_TILE_OUT), round_up(in_features, INT4_CUDA_TILE_IN)


def _check_torchao() -> None:
    if importlib.util.find_spec("torchao") is None:
        raise ViasdError("--quant int8/int4 need torchao: pip install 'viasd[quant]' (or pip install torchao)")


def fuse_rows(parts: list[torch.nn.Module]) -> PackedLinear | None:
    """One CPU int8/int4 layer computing the outputs of every layer of `parts` side by side (their
    rows concatenated: q, k and v, or gate and up), so a pass makes one call where it made several.
    The parts then view its packed data, so no weight is held twice (an int4 part's scales become a
    column slice, copied once if the part itself is ever called through PyTorch's kernel: its packed
    product reads the fused layer's, PackedLinear.bind). Each output is computed exactly
    as the part computes it (tested bit for bit): the kernels compute every block of outputs alike.
    None where the parts cannot share one packed layout: not all CPU int8/int4 layers of one kind
    and input width, bias on some only, or int4 row counts off the layout's blocks."""
    first = parts[0]
    if not all(isinstance(p, PackedLinear) and p.kind == first.kind and p.in_features == first.in_features
               and p.group == first.group and p.packed_in == p.in_features and p.qdata.device.type == "cpu"
               and p.qdata.shape[0] == p.out_features and p.scale.dtype == first.scale.dtype
               and (p.bias is None) == (first.bias is None) for p in parts):
        return None
    n, k = sum(p.out_features for p in parts), first.in_features
    if first.kind == "int4":
        block = _int4_cpu_block(n, k)
        if block is None or any(p.out_features % block or _int4_cpu_block(p.out_features, k) != block for p in parts):
            return None
    with torch.no_grad():
        qdata = torch.cat([p.qdata for p in parts])
        scale = torch.cat([p.scale for p in parts], dim=1 if first.kind == "int4" else 0)
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        fused = PackedLinear(first.kind, qdata, scale, n, k, first.group, bias, packed_kernel=first.packed_kernel,
                             bf16_pays=first.bf16_pays)
        lo = 0
        for p in parts:
            hi = lo + p.out_features
            p.set_packed(qdata[lo:hi], scale[:, lo:hi] if first.kind == "int4" else scale[lo:hi], (fused, lo))
            if bias is not None:
                p.bias = torch.nn.Parameter(fused.bias[lo:hi], requires_grad=False)
            lo = hi
    return fused


def _pack(linear: torch.nn.Linear, kind: str, dtype: torch.dtype | None = None,
          packed_kernel: bool = PACKED_KERNEL, bf16_pays: bool = True) -> PackedLinear:
    """`linear` packed as `kind`, from its weight in `dtype` (default: the weight's own dtype), its
    short CPU passes through viasd_kernels' packed products unless `packed_kernel` is False, its
    prefill's dense product in bfloat16 where `bf16_pays` (PackedLinear)."""
    import torchao.quantization as tq  # its import-time noise is quieted by loading.quiet_transformers

    w = linear.weight.detach() if dtype is None else linear.weight.detach().to(dtype)
    bias = linear.bias if linear.bias is None or dtype is None else linear.bias.to(dtype)
    if kind == "int8":
        q = tq.Int8Tensor.from_hp(w, granularity=tq.PerRow())
        return PackedLinear("int8", q.qdata.contiguous(), q.scale.reshape(-1).to(w.dtype).contiguous(), w.shape[0],
                            w.shape[1], w.shape[1], bias, packed_kernel=packed_kernel, bf16_pays=bf16_pays)
    layout = _int4_layout(w.device)
    q = layout.from_hp(w, [1, INT4_GROUP])
    return PackedLinear("int4", q.qdata, q.scale_and_zero, w.shape[0], w.shape[1], INT4_GROUP, bias,
                        cpu_layout=layout.__name__ == "Int4OpaqueTensor", packed_kernel=packed_kernel, bf16_pays=bf16_pays)


def int4_from_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                    packed_kernel: bool = PACKED_KERNEL, bf16_pays: bool = True) -> PackedLinear:
    """An int4 layer over codes chosen elsewhere (a GGUF file's blocks: loading/gguf_blocks.py), laid
    out as `_pack` lays out torchao's on the codes' device: codes [N, K] (0..15), scale and zero
    [N, K / INT4_GROUP] in the activations' dtype, each weight applied as tinygemm applies any:
    (q - 8) * scale + zero. On CUDA padded as torchao pads (int4_packed_shape: code 8, scale and
    zero 0, so the padding weighs nothing)."""
    n, k = codes.shape
    codes = codes.to(torch.int32)
    if codes.device.type == "cuda":
        pn, pk = int4_packed_shape(n, k, codes.device)
        codes = torch.nn.functional.pad(codes, (0, pk - k, 0, pn - n), value=8)
        scale, zero = (torch.nn.functional.pad(t, (0, (pk - k) // INT4_GROUP, 0, pn - n)) for t in (scale, zero))
        qdata = torch.ops.aten._convert_weight_to_int4pack(
            (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous(), 8)  # torchao's inner_k_tiles
    else:
        qdata = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scale_and_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K / group, N, 2]
    return PackedLinear("int4", qdata, scale_and_zero, n, k, INT4_GROUP, bias, cpu_layout=codes.device.type != "cuda",
                        packed_kernel=packed_kernel, bf16_pays=bf16_pays)


def int8_from_blocks(codes: torch.Tensor, scales: torch.Tensor, group: int, packed_kernel: bool = PACKED_KERNEL) -> PackedLinear:
    """An int8 layer over codes [N, K] (int8) with a float32 scale for each group of `group` inputs
    (scales [N, K / group]: a GGUF file's Q8_0 blocks, loading/gguf_blocks.py), each weight code *
    scale exactly; its outputs float32 (PackedLinear.grouped: the output head's logits)."""
    n, k = codes.shape
    return PackedLinear("int8", codes.to(torch.int8).contiguous(), scales.float().contiguous(), n, k, group, None,
                        packed_kernel=packed_kernel)


def _int4_layout(device: torch.device):
    """torchao's int4 tensor for tinygemm's kernel on `device`: tile-packed on CUDA, opaque on CPU."""
    if device.type == "cuda":
        from torchao.quantization.quantize_.workflows import Int4TilePackedTo4dTensor as Int4
    else:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor as Int4
    return Int4


def _kind(model: torch.nn.Module, name: str, module: torch.nn.Module, fmt: WeightFormat) -> str | None:
    """How `fmt` packs `module` (named `name` in `model`): int8, int4, or None (left as it is).

    The rule of the module doc: int4 layers with an int8 output head; a layer whose input width is
    not a multiple of the int4 group stays in floating point. `gguf`: the layers its file's blocks
    did not pack (loading/gguf_blocks.py) int8."""
    if not isinstance(module, torch.nn.Linear):
        return None
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = module is head_module if head_module is not None else name.split(".")[-1] == "lm_head"
    kind = "int8" if fmt.bits == 8 or head or fmt.from_file else "int4"
    return None if kind == "int4" and module.in_features % INT4_GROUP else kind


def _check_format(fmt: WeightFormat) -> None:
    if not fmt.packed:
        raise UsageError(f"weight format '{fmt}' is not packed by viasd: use {', '.join(FORMATS)}")
    _check_torchao()


def apply_weight_format(model: torch.nn.Module, fmt: WeightFormat, keep: tuple[str, ...] = (),
                        packed_kernel: bool = PACKED_KERNEL) -> None:
    """Replace `model`'s linear layers in place by `fmt` (int8 or int4; see the module doc), but
    those named in `keep` (`packed_kernel` False: short CPU passes through PyTorch's kernels).

    A tied output head gets its own int8 copy (the input embedding keeps its table: a lookup
    reads one row). Layers whose input width is not a multiple of the int4 group stay as they are.
    The machine's bfloat16 verdict is the one its loader recorded on `model` (bf16_pays_of).
    """
    _check_format(fmt)
    bf16_pays = bf16_pays_of(model)
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None  # the head's weight is replaced; it is no longer the embedding
    with torch.no_grad():
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                full = f"{parent_name}.{name}".lstrip(".")
                kind = None if full in keep else _kind(model, full, child, fmt)
                if kind is not None:
                    setattr(parent, name, _pack(child, kind, packed_kernel=packed_kernel, bf16_pays=bf16_pays))


def packed_copy(model: torch.nn.Module, fmt: WeightFormat, packed_kernel: bool = PACKED_KERNEL) -> torch.nn.Module:
    """A copy of `model` in `fmt`, as `--quant fmt` would load it (`packed_kernel`: as in
    apply_weight_format); `model` is left untouched.

    The linear layers are packed from the original weights rounded to the activation dtype; the
    other parameters (embedding, norms) are copied in that dtype; buffers (RoPE's frequencies) as
    they are. This is the lower-precision twin a slim view can run (slim_view.py)."""
    import copy

    _check_format(fmt)
    device = next(model.parameters()).device
    dtype = activation_dtype(fmt, None, device)
    bf16_pays = bf16_pays_of(model)
    memo: dict[int, object] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            kind = _kind(model, name, module, fmt)
            if kind is not None:
                memo[id(module)] = _pack(module, kind, dtype, packed_kernel, bf16_pays)
                continue
            for p in module.parameters(recurse=False):
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype) if p.is_floating_point() else p.detach().clone(),
                                                     requires_grad=False)
        twin = copy.deepcopy(model, memo)
    if hasattr(twin, "_tied_weights_keys"):
        twin._tied_weights_keys = None
    return twin


def packed_bytes(model: torch.nn.Module, fmt: WeightFormat) -> int:
    """Bytes `packed_copy(model, fmt)` will hold, estimated from the shapes before making it:
    int8 1 byte a weight plus a 2-byte scale a row; int4 half a byte a weight plus a 2-byte scale
    and zero per group of 32, over the packed (on CUDA padded) shape; the other parameters 2 bytes
    each (bfloat16)."""
    total = 0
    kept: dict[int, int] = {}  # parameters left in floating point (a tied embedding among them)
    for name, module in model.named_modules():
        kind = _kind(model, name, module, fmt)
        if kind == "int8":
            total += module.out_features * (module.in_features + 2)
        elif kind == "int4":
            n, k = int4_packed_shape(module.out_features, module.in_features, module.weight.device)
            total += n * (k // 2 + 4 * (k // INT4_GROUP))
        else:
            kept.update((id(p), p.numel() * 2) for p in module.parameters(recurse=False))
    total += sum(kept.values())
    return total


def has_weight_format(model: torch.nn.Module) -> bool:
    """Whether any layer of `model` holds weight-only packed weights (PackedLinear)."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by `model`'s parameters and buffers (a tensor shared by two modules counted once)."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
