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

from .errors import UsageError, ViasdError

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
    from .loading import EMBEDDED_ALIASES

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


def _pack(linear: torch.nn.Linear, kind: str) -> PackedLinear:
    import torchao.quantization as tq  # its import-time noise is quieted by loading.quiet_transformers

    w = linear.weight.detach()
    if kind == "int8":
        q = tq.Int8Tensor.from_hp(w, granularity=tq.PerRow())
        return PackedLinear("int8", q.qdata.contiguous(), q.scale.reshape(-1).to(w.dtype).contiguous(), w.shape[0],
                            w.shape[1], w.shape[1], linear.bias)
    if w.device.type == "cuda":
        from torchao.quantization.quantize_.workflows import Int4TilePackedTo4dTensor as Int4
    else:
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor as Int4
    q = Int4.from_hp(w, [1, INT4_GROUP])
    return PackedLinear("int4", q.qdata, q.scale_and_zero, w.shape[0], w.shape[1], INT4_GROUP, linear.bias)


def apply_weight_format(model: torch.nn.Module, quant: str) -> None:
    """Replace `model`'s linear layers in place by `quant` (int8 or int4; see the module doc).

    A tied output head gets its own int8 copy (the input embedding keeps its table: a lookup
    reads one row). Layers whose input width is not a multiple of the int4 group stay as they are.
    """
    if quant not in FORMATS:
        raise UsageError(f"unknown weight format '{quant}': use {', '.join(FORMATS)}")
    _check_torchao()
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None  # the head's weight is replaced; it is no longer the embedding
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                head = child is model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else name == "lm_head"
                kind = "int8" if quant == "int8" or head else "int4"
                if kind == "int4" and child.in_features % INT4_GROUP:
                    continue
                setattr(parent, name, _pack(child, kind))


def has_weight_format(model: torch.nn.Module) -> bool:
    """Whether any layer of `model` holds weight-only packed weights (PackedLinear)."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by `model`'s parameters and buffers (a tensor shared by two modules counted once)."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
