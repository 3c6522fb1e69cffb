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
it is fast eagerly and compiles like a float model. On a CPU with AVX-512 BF16 the short passes
(decoding, verify blocks) call viasd_kernels' packed products instead (cpu_packed_mm: a 6-token int4
verify pass of SmolLM2 1.56x a 1-token pass, against 1.81x through PyTorch's kernels; docs/benchmarks.md
section 30), over the same packed tensors. int8 on CUDA calls viasd_kernels' int8
matmul instead (a Triton kernel in a custom op, which compiles and which CUDA graphs capture):
the gpt-fast form it replaces, `mm(x, w.to(bf16)) * scale`, widened every weight to a bfloat16
copy at every call, compiled or not (kernels/int8_mm.py says what that costs).

int4 on CUDA: torchao's tile-packed layout pads the weight's input width to a multiple of 1024
(and its output width to a multiple of 8), and the kernel wants the activation just as wide, in
bfloat16, on a GPU of compute capability 8.0 or newer. `PackedLinear` reads the packed width from
the packed scales and pads the activation to it, as torchao's own linear does; an older GPU is
refused when the format is chosen (weight_format.WeightFormat.check_device).

Which format is a value (weight_format.WeightFormat); this module packs the torchao ones.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
from viasd_kernels import cpu_int4_widen, cpu_packed_mm, int8_mm

from viasd_core import paths
from viasd_core.bf16_choice import bf16_products_pay
from viasd_core.decoding.weight_format import PACKED, WeightFormat
from viasd_core.errors import UsageError, ViasdError

FORMATS = tuple(f.name for f in PACKED)  # the names of the formats packed here (slim views' twins)
INT4_GROUP = 32
INT4_CUDA_TILE_IN, INT4_CUDA_TILE_OUT = 1024, 8  # torchao's tile-packed layout pads the weight to these


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


DENSE_PREFILL_ROWS = 17  # on CPU, a pass of this many rows or more (a prefill chunk) takes one dense product
PACKED_KERNEL = True  # short CPU passes through viasd_kernels.cpu_packed_mm where it runs (benchmarks turn it off)


def _int8_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the int8 weight qdata [N, K] with one scale a row [N] -> [M, N]: on CUDA
    viasd_kernels' int8 matmul (a Triton kernel that widens the weight tile by tile in registers:
    no per-call copy of the weight, inside or outside a compiled graph); on CPU PyTorch's own
    (`_int8_mm_reference`, compared with the kernel in tests/test_kernels_int8_mm.py). CPU passes of
    DENSE_PREFILL_ROWS rows or more do not come here (PackedLinear.forward)."""
    if x.is_cuda:
        return int8_mm(x, qdata, scale)
    return _int8_mm_reference(x, qdata, scale)


def _int8_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """PyTorch's CPU int8 weight-only kernel, at any number of rows."""
    return torch._weight_int8pack_mm(x, qdata, scale)


def _int4_mm(x: torch.Tensor, qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K the packed input width) times an int4 weight -> [M, N] (N the packed output width):
    tinygemm's kernel on x's device, at any number of rows. CPU passes of DENSE_PREFILL_ROWS rows or
    more do not come here (PackedLinear.forward)."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qdata, group, scale_and_zero)
    return torch.ops.aten._weight_int4pack_mm(x, qdata, group, scale_and_zero)


# ---------------------------------------------------------------------- tinygemm's CPU layout, read back
# PyTorch packs a CPU int4 weight [N, K] for its vector width: blocks of BLOCK_N rows (64 with
# AVX-512, 32 with AVX2), each stored K-major as [K, BLOCK_N / 2] bytes whose low nibble is row j of
# the block and high nibble row j + BLOCK_N / 2 (aten/src/ATen/native/cpu/int4mm_kernel.cpp). Which
# block size this build and CPU use is found by packing a probe and reading it back; where neither
# reads back (another layout, a partial last block) the kernel is used at every size.
_INT4_CPU_BLOCKS = (64, 32)
_int4_cpu_block_of: dict[tuple[int, int], int | None] = {}


def _int4_unpack_cpu(qdata: torch.Tensor, n: int, k: int, block: int, dtype=torch.uint8) -> torch.Tensor:
    """The 4-bit values [n, k] (0..15, in `dtype`) of a CPU-packed weight in blocks of `block` rows:
    each half of a block is copied (and converted) in one pass from its nibbles."""
    b = qdata.reshape(n // block, k, block // 2)
    out = torch.empty(n // block, 2, block // 2, k, dtype=dtype, device=qdata.device)
    out[:, 0].copy_((b & 0xF).transpose(1, 2))
    out[:, 1].copy_((b >> 4).transpose(1, 2))
    return out.view(n, k)


def _int4_cpu_block(n: int, k: int) -> int | None:
    """The block size PyTorch packs an [n, k] int4 weight with here (None: not this layout)."""
    key = (n, k)
    if key not in _int4_cpu_block_of:
        rows = 128 if n % 128 == 0 else n  # every full block is laid out alike: two of the largest suffice
        probe = torch.randint(0, 16, (rows, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        _int4_cpu_block_of[key] = next(
            (b for b in _INT4_CPU_BLOCKS if rows % b == 0 and packed.shape == (rows, k // 2)
             and torch.equal(_int4_unpack_cpu(packed, rows, k, b), probe.to(torch.uint8))), None)
    return _int4_cpu_block_of[key]


def _int4_dense_cpu(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight [N, K] in `dtype` that tinygemm's CPU kernel applies: q * scale + (zero - 8 * scale)
    per group of `group` inputs, in float32, rounded once to `dtype`; None where the layout is
    unknown. In bfloat16, viasd_kernels' one-pass kernel where it runs (bit for bit the same values,
    3x faster here: cpu_int4_widen), else PyTorch's operators (`_int4_dense_reference`)."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    block = _int4_cpu_block(n, k)
    if block is None:
        return None
    if dtype == torch.bfloat16:
        w = cpu_int4_widen.widen(qdata, group, scale_and_zero, block, build_dir=paths.kernel_dir())
        if w is not None:
            return w
    return _int4_dense_reference(qdata, group, scale_and_zero, block).to(dtype)


def int4_widening_way() -> str:
    """How a CPU int4 prefill widens each layer's weight on this machine, and why (viasd doctor shows it)."""
    probe, shifts = torch.zeros(32, 16, dtype=torch.uint8), torch.zeros(1, 32, 2, dtype=torch.bfloat16)
    if cpu_int4_widen.widen(probe, 32, shifts, 32, build_dir=paths.kernel_dir()) is not None:
        return "viasd_kernels' one-pass kernel (built for this CPU)"
    return f"PyTorch's operators: {cpu_int4_widen.why_not() or 'the kernel does not run here'}"


def short_products_way() -> str:
    """How a CPU int8/int4 layer multiplies in short passes (decoding, verify blocks) on this machine,
    and why (viasd doctor shows it)."""
    if not PACKED_KERNEL:
        return "PyTorch's kernels (the packed products are turned off)"
    if cpu_packed_mm.available(paths.kernel_dir()):
        return f"viasd_kernels' packed products (each weight widened once a pass: {cpu_packed_mm.way(paths.kernel_dir())})"
    return f"PyTorch's kernels: {cpu_packed_mm.why_not(paths.kernel_dir())}"


def _int4_dense_reference(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int) -> torch.Tensor:
    """`_int4_dense_cpu` with PyTorch's operators, in float32 (not rounded): each half of a block
    unpacked to float32, times the scales, plus the shifts, in place."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    scale, zero = scale_and_zero.float().permute(2, 1, 0)  # each [N, K / group]
    w = _int4_unpack_cpu(qdata, n, k, block, torch.float32).view(n, k // group, group)
    w.mul_(scale[..., None]).add_((zero - 8 * scale)[..., None])
    return w.view(n, k)


def dense_dtype(activations: torch.dtype) -> torch.dtype:
    """The dtype of a CPU prefill's dense product: the activations', except bfloat16 where bfloat16
    products do not pay on this CPU (no bfloat16 instructions: bf16_choice), then float32 over the
    same weight values (a 768-token int4 prefill of SmolLM2 on an AVX2-only CPU: 10.8 s in bfloat16)."""
    if activations == torch.bfloat16 and not bf16_products_pay("cpu"):
        return torch.float32
    return activations


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
        # The input width the kernel reads: int4's scale_and_zero is [packed in / group, packed out, 2]
        # in both tinygemm layouts, so the padding of the layout the weight was packed in is read here.
        self.packed_in = scale.shape[0] * group if kind == "int4" else in_features
        if self.packed_in < in_features:
            raise ValueError(f"packed int4 weight of width {self.packed_in} for a layer of width {in_features}")
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)  # int8: [out]; int4: tinygemm's scale_and_zero
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.holding = False  # while `widen_once` holds the widened weight (`held`; None: no dense form)
        self._contiguous_scale: torch.Tensor | None = None  # int4 fused part: its scales, copied on first use
        self.cpu_layout = True  # int4: packed in PyTorch's CPU layout (not torchao's CUDA tiles)
        self._short: cpu_packed_mm.Bound | bool | None = None  # short CPU passes' kernel (False: PyTorch's; None: not decided)
        self.held: torch.Tensor | None = None

    def widened(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight [out, in] exactly as the CPU kernel applies it (int8: q * scale, rounded once
        to the scale's dtype; int4: `_int4_dense_cpu`, rounded once to bfloat16), held in `dtype`
        (float32 where bfloat16 products do not pay: the same values); None off the CPU or where
        int4's layout is unknown."""
        if self.qdata.device.type != "cpu":
            return None
        applied = self.scale.dtype
        if self.kind == "int8":
            w = self.qdata.to(applied) * self.scale[:, None]
        else:
            w = _int4_dense_cpu(self.qdata, self.group, self.scale, applied)
        return None if w is None else w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Passes of up to 16 rows (decoding, every verify block) run the format's kernel, so a
        row's numbers never depend on its pass (sd == ar): on a CPU with AVX-512 BF16 viasd_kernels'
        packed products (cpu_packed_mm: each weight widened once a pass, where PyTorch's kernels
        widen it again for every 4 rows), else PyTorch's. On CPU, longer ones (prompt prefill
        chunks, which every mode runs alike) take one dense product over the widened weight: the
        kernels are built for few rows (tinygemm streams the whole weight again for every 4 rows),
        and a 768-token prefill of SmolLM2 took 1546 ms through PyTorch's int8 kernel against
        1064 ms this way (docs/benchmarks.md section 14). The weight is the one `widen_once` holds
        (a prefill's chunks share it) or widened for this call."""
        return self._product(x, None)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, bit for bit: in the short products' own call where they run (the
        residual added as each output is stored: a pass's residual adds without an operator each)."""
        return self._product(x, residual)

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        # Called 4 times a layer in every pass: buffers and parameters are read from their dicts
        # (nn.Module.__getattr__ costs ~0.7 us a name), and nothing is done that a pass does not need.
        qdata, scale = self._buffers["qdata"], self._buffers["scale"]
        bias = self._parameters.get("bias")
        if (x.dtype == torch.bfloat16 and not x.is_cuda and x.numel() <= self.in_features * cpu_packed_mm.MAX_ROWS
                and not torch.compiler.is_compiling() and (short := self._short_product(qdata, scale)) is not None):
            x = x.contiguous()
            if (residual is not None and bias is None and short.n == self.out_features
                    and residual.dtype == torch.bfloat16 and residual.is_contiguous()
                    and residual.shape == (*x.shape[:-1], short.n)):
                return short(x, residual)
            y = short(x)  # [..., N]: a pass's product without reshapes (~2 us of its ~8)
            if short.n != self.out_features:
                y = y[..., : self.out_features]
            y = y if bias is None else y + bias
            return y if residual is None else residual + y
        x2 = x.reshape(-1, self.in_features)
        dense = None
        if x2.shape[0] >= DENSE_PREFILL_ROWS and qdata.is_cpu:
            dense = self.held if self.holding else self.widened(dense_dtype(x2.dtype))
        if dense is not None:
            y = torch.nn.functional.linear(x2.to(dense.dtype), dense).to(x2.dtype)
        elif self.kind == "int8":
            y = _int8_mm(x2.contiguous(), qdata, scale)
        else:
            if self.packed_in != self.in_features:  # CUDA's tile layout: zero columns up to the packed width
                x2 = torch.nn.functional.pad(x2, (0, self.packed_in - self.in_features))
            y = _int4_mm(x2.contiguous(), qdata, self.group, self._scales(scale))  # tinygemm reads them as contiguous
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]  # tinygemm pads the output width
        if bias is not None:
            y = y + bias
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if residual is None else residual + y

    def _scales(self, scale: torch.Tensor) -> torch.Tensor:
        """int4's scales as the kernels read them, contiguous: a layer fused with others (fuse_rows)
        views a column slice, copied once on its first own call (transformers' forward: bench's
        baselines, fidelity)."""
        if scale.is_contiguous():
            return scale
        if self._contiguous_scale is None:
            self._contiguous_scale = scale.contiguous()
        return self._contiguous_scale

    def _short_product(self, qdata: torch.Tensor, scale: torch.Tensor) -> cpu_packed_mm.Bound | None:
        """This layer's product for short CPU passes from viasd_kernels (cpu_packed_mm), bound to its
        weight, or None (PyTorch's kernel): decided once per layer from its tensors and the machine,
        never from a pass's width, so every pass of the layer takes the same kernel (sd == ar); bound
        again if the layer's tensors were replaced."""
        bound = self._short
        if bound is False:
            return None
        if bound is None or bound.weights[0] is not qdata or bound.weights[1] is not self._scales(scale):
            bound = None
            if PACKED_KERNEL and self.kind == "int4" and self.cpu_layout:
                bound = cpu_packed_mm.bind_int4(qdata, self.group, self._scales(scale),
                                                _int4_cpu_block(qdata.shape[0], qdata.shape[1] * 2),
                                                build_dir=paths.kernel_dir())
            elif PACKED_KERNEL:
                bound = cpu_packed_mm.bind_int8(qdata, scale, build_dir=paths.kernel_dir())
            self._short = False if bound is None else bound
        return bound

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.kind == "int4" else ""
        padded = f", packed_in={self.packed_in}" if self.packed_in != self.in_features else ""
        return f"{self.kind}, in={self.in_features}, out={self.out_features}{group}{padded}"


def fuse_rows(parts: list[torch.nn.Module]) -> PackedLinear | None:
    """One CPU int8/int4 layer computing the outputs of every layer of `parts` side by side (their
    rows concatenated: q, k and v, or gate and up), so a pass makes one call where it made several.
    The parts then view its packed data, so no weight is held twice (an int4 part's scales become a
    column slice, copied once if the part itself is ever called). Each output is computed exactly
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
        fused = PackedLinear(first.kind, qdata, scale, n, k, first.group, bias)
        lo = 0
        for p in parts:
            hi = lo + p.out_features
            p.qdata = qdata[lo:hi]
            p.scale = scale[:, lo:hi] if first.kind == "int4" else scale[lo:hi]
            p._contiguous_scale, p._short = None, None
            if bias is not None:
                p.bias = torch.nn.Parameter(fused.bias[lo:hi], requires_grad=False)
            lo = hi
    return fused


@contextlib.contextmanager
def widen_once(modules: list[torch.nn.Module], dtype: torch.dtype):
    """Within the block, every CPU int8/int4 layer in `modules` holds its weight widened to `dtype`
    (PackedLinear.widened), so the chunks of a long prefill, run layer by layer, widen each layer
    once instead of once a chunk. The products of one decoder layer are held at a time; they are
    dropped on leaving the block."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, PackedLinear)]
    try:
        for m in layers:
            m.held, m.holding = m.widened(dense_dtype(dtype)), True
        yield
    finally:
        for m in layers:
            m.held, m.holding = None, False


def _pack(linear: torch.nn.Linear, kind: str, dtype: torch.dtype | None = None) -> PackedLinear:
    """`linear` packed as `kind`, from its weight in `dtype` (default: the weight's own dtype)."""
    import torchao.quantization as tq  # its import-time noise is quieted by loading.quiet_transformers

    w = linear.weight.detach() if dtype is None else linear.weight.detach().to(dtype)
    bias = linear.bias if linear.bias is None or dtype is None else linear.bias.to(dtype)
    if kind == "int8":
        q = tq.Int8Tensor.from_hp(w, granularity=tq.PerRow())
        return PackedLinear("int8", q.qdata.contiguous(), q.scale.reshape(-1).to(w.dtype).contiguous(), w.shape[0],
                            w.shape[1], w.shape[1], bias)
    layout = _int4_layout(w.device)
    q = layout.from_hp(w, [1, INT4_GROUP])
    packed = PackedLinear("int4", q.qdata, q.scale_and_zero, w.shape[0], w.shape[1], INT4_GROUP, bias)
    packed.cpu_layout = layout.__name__ == "Int4OpaqueTensor"
    return packed


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
    not a multiple of the int4 group stays in floating point."""
    if not isinstance(module, torch.nn.Linear):
        return None
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = module is head_module if head_module is not None else name.split(".")[-1] == "lm_head"
    kind = "int8" if fmt.bits == 8 or head else "int4"
    return None if kind == "int4" and module.in_features % INT4_GROUP else kind


def _check_format(fmt: WeightFormat) -> None:
    if not fmt.packed:
        raise UsageError(f"weight format '{fmt}' is not packed by viasd: use {', '.join(FORMATS)}")
    _check_torchao()


def apply_weight_format(model: torch.nn.Module, fmt: WeightFormat, keep: tuple[str, ...] = ()) -> None:
    """Replace `model`'s linear layers in place by `fmt` (int8 or int4; see the module doc), but
    those named in `keep`.

    A tied output head gets its own int8 copy (the input embedding keeps its table: a lookup
    reads one row). Layers whose input width is not a multiple of the int4 group stay as they are.
    """
    _check_format(fmt)
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None  # the head's weight is replaced; it is no longer the embedding
    with torch.no_grad():
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                full = f"{parent_name}.{name}".lstrip(".")
                kind = None if full in keep else _kind(model, full, child, fmt)
                if kind is not None:
                    setattr(parent, name, _pack(child, kind))


def packed_copy(model: torch.nn.Module, fmt: WeightFormat) -> torch.nn.Module:
    """A copy of `model` in `fmt`, as `--quant fmt` would load it; `model` is left untouched.

    The linear layers are packed from the original weights rounded to the activation dtype; the
    other parameters (embedding, norms) are copied in that dtype; buffers (RoPE's frequencies) as
    they are. This is the lower-precision twin a slim view can run (slim_view.py)."""
    import copy

    _check_format(fmt)
    device = next(model.parameters()).device
    dtype = activation_dtype(fmt, None, device)
    memo: dict[int, object] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            kind = _kind(model, name, module, fmt)
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
