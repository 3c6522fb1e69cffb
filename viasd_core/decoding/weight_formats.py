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
  (docs/benchmarks.md section 10).

Both run with bfloat16 activations (on CPU tinygemm's int4 kernel is ~10x slower on float32
inputs); embeddings and norms stay in bfloat16. torchao chooses the quantization parameters and
packs the weights; the pass then calls PyTorch's kernels on plain tensors (`PackedLinear`), so
it is fast eagerly and compiles like a float model.
"""

from __future__ import annotations

import importlib.util

import torch

from viasd_core.errors import UsageError, ViasdError

FORMATS = ("int8", "int4")  # torchao weight-only; bitsandbytes keeps "8bit" / "4bit"
INT4_GROUP = 32


def is_weight_format(quant: str) -> bool:
    return quant in FORMATS


def default_quant(quant: str, model_ref: str | None, device: torch.device, dtype: str | None) -> str:
    """`auto` -> the format to run: `int4` for the embedded target on CPU where torchao is installed
    and no --dtype was given (on this project's CPU the fastest format whose measured agreement with
    fp32 meets 0.97: docs/benchmarks.md section 10), `none` elsewhere (not measured there)."""
    if quant != "auto":
        return quant
    from viasd_core.loading.models import EMBEDDED_ALIASES

    embedded = (model_ref or "").lower() in EMBEDDED_ALIASES
    if embedded and device.type == "cpu" and dtype is None and importlib.util.find_spec("torchao") is not None:
        return "int4"
    return "none"


def activation_dtype(quant: str, dtype: str | None, device: torch.device) -> torch.dtype:
    """The activations' dtype for a torchao format: bfloat16 (float16 on a GPU without bf16)."""
    want = torch.bfloat16 if device.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
    if dtype is not None and dtype != str(want).removeprefix("torch."):
        raise UsageError(f"--quant {quant} runs with {str(want).removeprefix('torch.')} activations: drop --dtype {dtype}")
    return want


def _check_torchao() -> None:
    if importlib.util.find_spec("torchao") is None:
        raise ViasdError("--quant int8/int4 need torchao: pip install 'viasd[quant]' (or pip install torchao)")


class PackedLinear(torch.nn.Module):
    """A linear layer over torchao-packed weight-only data, calling PyTorch's own kernels.

    torchao chooses the quantization parameters and packs the weight; the packed tensors are then
    held as plain buffers, so the pass stays an ordinary graph: the eager pass is fast (no
    dequantization per call), torch.compile traces it like a float model (seconds per graph, and
    inductor's on-disk cache applies), and the model's own forward (transformers') uses it too.
    """

    def __init__(self, kind: str, qdata: torch.Tensor, scale: torch.Tensor, out_features: int, in_features: int,
                 group: int, bias: torch.Tensor | None):
        super().__init__()
        self.kind, self.out_features, self.in_features, self.group = kind, out_features, in_features, group
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)  # int8: [out]; int4: tinygemm's scale_and_zero
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kind == "int8":
            if x2.device.type == "cpu":
                y = torch._weight_int8pack_mm(x2.contiguous(), self.qdata, self.scale)
            else:  # the gpt-fast form, which inductor fuses into one kernel
                y = torch.mm(x2, self.qdata.t().to(x2.dtype)) * self.scale
        elif x2.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.qdata, self.group, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), self.qdata, self.group, self.scale)
        y = y[:, : self.out_features]  # tinygemm pads the output width
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}" + (f", group={self.group}" if self.kind == "int4" else "")


def _pack(linear: torch.nn.Linear, kind: str, dtype: torch.dtype | None = None) -> PackedLinear:
    """`linear` packed as `kind`, from its weight in `dtype` (default: the weight's own dtype)."""
    import torchao.quantization as tq  # its import-time noise is quieted by loading.quiet_transformers

    w = linear.weight.detach() if dtype is None else linear.weight.detach().to(dtype)
    bias = linear.bias if linear.bias is None or dtype is None else linear.bias.to(dtype)
    if kind == "int8":
        q = tq.Int8Tensor.from_hp(w, granularity=tq.PerRow())
        return PackedLinear("int8", q.qdata.contiguous(), q.scale.reshape(-1).to(w.dtype).contiguous(), w.shape[0],
                            w.shape[1], w.shape[1], bias)
    if w.device.type == "cuda":
        from torchao.quantization.quantize_.workflows import Int4TilePackedTo4dTensor as Int4
    else:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor as Int4
    q = Int4.from_hp(w, [1, INT4_GROUP])
    return PackedLinear("int4", q.qdata, q.scale_and_zero, w.shape[0], w.shape[1], INT4_GROUP, bias)


def _kind(model: torch.nn.Module, name: str, module: torch.nn.Module, quant: str) -> str | None:
    """How `quant` packs `module` (named `name` in `model`): int8, int4, or None (left as it is).

    The rule of the module doc: int4 layers with an int8 output head; a layer whose input width is
    not a multiple of the int4 group stays in floating point."""
    if not isinstance(module, torch.nn.Linear):
        return None
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = module is head_module if head_module is not None else name.split(".")[-1] == "lm_head"
    kind = "int8" if quant == "int8" or head else "int4"
    return None if kind == "int4" and module.in_features % INT4_GROUP else kind


def _check_format(quant: str) -> None:
    if quant not in FORMATS:
        raise UsageError(f"unknown weight format '{quant}': use {', '.join(FORMATS)}")
    _check_torchao()


def apply_weight_format(model: torch.nn.Module, quant: str) -> None:
    """Replace `model`'s linear layers in place by `quant` (int8 or int4; see the module doc).

    A tied output head gets its own int8 copy (the input embedding keeps its table: a lookup
    reads one row). Layers whose input width is not a multiple of the int4 group stay as they are.
    """
    _check_format(quant)
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None  # the head's weight is replaced; it is no longer the embedding
    with torch.no_grad():
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                kind = _kind(model, f"{parent_name}.{name}".lstrip("."), child, quant)
                if kind is not None:
                    setattr(parent, name, _pack(child, kind))


def packed_copy(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """A copy of `model` in `quant`, as `--quant quant` would load it; `model` is left untouched.

    The linear layers are packed from the original weights rounded to the activation dtype; the
    other parameters (embedding, norms) are copied in that dtype; buffers (RoPE's frequencies) as
    they are. This is the lower-precision twin a slim view can run (slim_view.py)."""
    import copy

    _check_format(quant)
    device = next(model.parameters()).device
    dtype = activation_dtype(quant, None, device)
    memo: dict[int, object] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            kind = _kind(model, name, module, quant)
            if kind is not None:
                memo[id(module)] = _pack(module, kind, dtype)
                continue
            for p in module.parameters(recurse=False):
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype) if p.is_floating_point() else p.detach().clone(),
                                                     requires_grad=False)
        twin = copy.deepcopy(model, memo)
    if hasattr(twin, "_tied_weights_keys"):
        twin._tied_weights_keys = None
    return twin


def packed_bytes(model: torch.nn.Module, quant: str) -> int:
    """Bytes `packed_copy(model, quant)` will hold, estimated from the shapes before making it:
    int8 1 byte a weight plus a 2-byte scale a row; int4 half a byte a weight plus a 2-byte scale
    and zero per group of 32; the other parameters 2 bytes each (bfloat16)."""
    total = 0
    kept: dict[int, int] = {}  # parameters left in floating point (a tied embedding among them)
    for name, module in model.named_modules():
        kind = _kind(model, name, module, quant)
        if kind == "int8":
            total += module.out_features * (module.in_features + 2)
        elif kind == "int4":
            total += module.out_features * (module.in_features // 2 + 4 * (module.in_features // INT4_GROUP))
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
