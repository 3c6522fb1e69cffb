"""`PackedLinear`: a linear layer over torchao-packed int8/int4 weights, the module each `nn.Linear`
of a model is replaced by (weight_formats.py packs them and says why the formats run so), and
`widen_once`, which holds the widened weights for a long prefill.

A pass takes the kernel the layer's rows call for: on a CPU, short passes (decoding, verify
blocks) the one `bind` chose for the layer when it was made or its tensors set, never per pass
(viasd_kernels' packed products, packed_cpu.py, else PyTorch's kernels, packed_torch.py), and
prefill chunks one dense product over the widened weight (packed_cpu.py).
"""

from __future__ import annotations

import contextlib

import torch
from viasd_kernels import cpu_packed_mm

from viasd_core.runtime import packed_cpu, packed_torch
from viasd_core.runtime.packed_cpu import PACKED_KERNEL, bind_rows, bind_short, dense_dtype

DENSE_PREFILL_ROWS = 17  # on CPU, a pass of this many rows or more (a prefill chunk) takes one dense product
NO_DENSE_ROWS = 2**62  # off the CPU: no pass takes the dense product
# what `bind` sets from the layer's tensors (made again when a layer is unpickled)
BOUND = ("_eager", "_eager_add", "_traced", "_traced_add", "_mm", "_kernel_rows", "_dense_rows", "_short_numel",
         "_long")


class PackedLinear(torch.nn.Module):
    """A linear layer over torchao-packed weight-only data, calling PyTorch's own kernels.

    torchao chooses the quantization parameters and packs the weight; the packed tensors are then
    held as plain buffers, so the pass stays an ordinary graph: the eager pass is fast (no
    dequantization per call), torch.compile traces it like a float model (seconds per graph, and
    inductor's on-disk cache applies), and the model's own forward (transformers') uses it too.
    """

    def __init__(self, kind: str, qdata: torch.Tensor, scale: torch.Tensor, out_features: int, in_features: int,
                 group: int, bias: torch.Tensor | None, cpu_layout: bool = True, packed_kernel: bool = PACKED_KERNEL,
                 bf16_pays: bool = True):
        super().__init__()
        self.kind, self.out_features, self.in_features, self.group = kind, out_features, in_features, group
        # The input width the kernel reads: int4's scale_and_zero is [packed in / group, packed out, 2]
        # in both tinygemm layouts, so the padding of the layout the weight was packed in is read here.
        self.packed_in = scale.shape[0] * group if kind == "int4" else in_features
        if self.packed_in < in_features:
            raise ValueError(f"packed int4 weight of width {self.packed_in} for a layer of width {in_features}")
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)  # int8: [out] (or `grouped`); int4: tinygemm's scale_and_zero
        # int8 with a float32 scale for each group of `group` inputs ([out, in / group]: a GGUF file's
        # Q8_0 output head, exactly): float32 outputs (logits), never rounded to the activations' dtype
        self.grouped = kind == "int8" and scale.dim() == 2
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.holding = False  # while `widen_once` holds the widened weight (`held`; None: no dense form)
        self._contiguous_scale: torch.Tensor | None = None  # int4 fused part: its scales, copied once for PyTorch's kernel
        self.cpu_layout = cpu_layout  # int4: packed in PyTorch's CPU layout (not torchao's CUDA tiles)
        self.packed_kernel = packed_kernel  # short CPU passes through viasd_kernels' packed products where they run
        self.bf16_pays = bf16_pays  # the machine's verdict (machine/bf16.py), given at load: a prefill's dense product's dtype
        self.rows_of: tuple[PackedLinear, int] | None = None  # (fused layer, first row) whose rows this one views
        self._short: cpu_packed_mm.Bound | None = None  # short CPU passes' kernel (None: PyTorch's), set by `bind`
        self.held: torch.Tensor | None = None
        self.bind()

    def bind(self, packed_kernel: bool | None = None) -> None:
        """Decides this layer's product for short CPU passes, once: viasd_kernels' (cpu_packed_mm)
        bound to its weight, or PyTorch's kernel (packed_cpu.bind_short), from its tensors and the
        machine, never from a pass's width, so every pass of the layer takes the same kernel (sd ==
        ar). Called when the layer is made and when its tensors are set (`set_packed`) or moved
        (`.to`): a pass only calls what was bound. `packed_kernel` (kept for later binds; made with
        packed_cpu.PACKED_KERNEL unless given) False: PyTorch's kernels. An int4 layer that views a
        fused layer's rows takes that layer's kernel over its rows (packed_cpu.bind_rows: no copy)."""
        if packed_kernel is not None:
            self.packed_kernel = packed_kernel
        qdata, scale = self._buffers["qdata"], self._buffers["scale"]
        if self.rows_of is not None and self.kind == "int4":
            whole, lo = self.rows_of
            if whole.packed_kernel != self.packed_kernel:
                whole.bind(self.packed_kernel)
            self._short = bind_rows(whole._short, qdata, scale, lo)
        else:
            int4_cpu = self.kind == "int4" and self.cpu_layout
            self._short = bind_short(self.kind, qdata, self._scales(scale) if int4_cpu else scale, self.group,
                                     self.cpu_layout, self.packed_kernel)
        self._bind_calls()

    def set_packed(self, qdata: torch.Tensor, scale: torch.Tensor, rows_of: tuple[PackedLinear, int] | None = None):
        """Holds `qdata` and `scale` from now on (with `rows_of`, (fused layer, first row): they view
        that layer's rows from its first row on, fuse_rows) and binds its product again."""
        self.qdata, self.scale = qdata, scale
        self._contiguous_scale, self.rows_of = None, rows_of
        self.bind()

    def _apply(self, fn, recurse=True):
        qdata, scale = self._buffers["qdata"], self._buffers["scale"]
        module = super()._apply(fn, recurse)
        if self._buffers["qdata"] is not qdata or self._buffers["scale"] is not scale:  # moved or converted
            self._contiguous_scale, self.rows_of = None, None
            self.bind()
        return module

    def __getstate__(self):
        # a bound kernel holds C functions, and the bound calls this layer's methods: bound on arrival
        return {k: v for k, v in super().__getstate__().items() if k not in BOUND} | {"_short": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.bind()

    def widened(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight [out, in] exactly as the CPU kernel applies it (int8: q * scale, rounded once
        to the scale's dtype; int4: packed_cpu._int4_dense_cpu, rounded once to bfloat16), held in
        `dtype` (float32 where bfloat16 products do not pay: the same values); None off the CPU or
        where int4's layout is unknown."""
        if self.qdata.device.type != "cpu":
            return None
        applied = self.scale.dtype
        if self.grouped:
            return packed_torch.int8_grouped_weight(self.qdata, self.scale).to(dtype)
        if self.kind == "int8":
            w = self.qdata.to(applied) * self.scale[:, None]
        else:
            w = packed_cpu._int4_dense_cpu(self.qdata, self.group, self.scale, applied)
        return None if w is None else w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Passes of up to 16 rows (decoding, every verify block) run the format's kernel, so a
        row's numbers never depend on its pass (sd == ar): on a CPU with AVX-512 BF16 viasd_kernels'
        packed products (cpu_packed_mm: each weight widened once a pass, where PyTorch's kernels
        widen it again for every 4 rows), else PyTorch's. On CPU, longer ones (prompt prefill
        chunks, which every mode runs alike) take one dense product over the widened weight: the
        kernels are built for few rows (tinygemm streams the whole weight again for every 4 rows),
        and a 768-token prefill of SmolLM2 took 1546 ms through PyTorch's int8 kernel against
        1064 ms this way (docs/experiments/int8-prefill-dense-product.md). The weight is the one `widen_once` holds
        (a prefill's chunks share it) or widened for this call.

        The calls `bind` chose: `_eager` (what an eager pass calls: FastModel's layer calls call it
        directly) or, inside torch.compile's tracing, `_traced` (PyTorch's operators: viasd_kernels'
        CPU products are C calls). This entry is for callers that follow no plan (transformers'
        forward, the EAGLE head's step)."""
        return (self._traced if torch.compiler.is_compiling() else self._eager)(x)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`, bit for bit: in the short products' own call where they run (the
        residual added as each output is stored: a pass's residual adds without an operator each).
        `_eager_add` or, traced, `_traced_add`, as `forward`."""
        return (self._traced_add if torch.compiler.is_compiling() else self._eager_add)(x, residual)

    # ------------------------------------------------------------------ the calls `bind` chooses from
    def _bind_calls(self) -> None:
        """Decides, once, what a pass calls: `_traced`/`_traced_add` (PyTorch's kernels for the
        weight's device and layout, and on a CPU a prefill's dense product) and `_eager`/`_eager_add`
        (the short product bound to the weight first where `_short` is one, else the same as traced),
        so that no call tests the compile state, the device or the dtype."""
        qdata = self._buffers["qdata"]
        if self.grouped:  # every pass the kernel's or exact float32 products: no dense bfloat16 weight
            self._mm, self._kernel_rows = packed_torch.int8_grouped_mm, self._int8_rows
        elif self.kind == "int8":
            self._mm, self._kernel_rows = packed_torch.int8_mm_for(qdata), self._int8_rows
        else:
            self._mm, self._kernel_rows = packed_torch.int4_mm_for(self.cpu_layout), self._int4_rows
        self._dense_rows = DENSE_PREFILL_ROWS if qdata.is_cpu and not self.grouped else NO_DENSE_ROWS
        self._traced, self._traced_add = self._operators, self._operators_add
        short = self._short
        if short is None:
            self._eager, self._eager_add = self._operators, self._operators_add
            return
        self._short_numel = self.in_features * cpu_packed_mm.MAX_ROWS
        # passes longer than the short product takes (prefill chunks): in its chunks where it says so
        # (the int8-activation products, whose rows are the short passes' own), else dense
        self._long = self._short_chunks if short.chunks else self._operators
        if short.n == self.out_features and self._parameters.get("bias") is None and not self.grouped:
            self._eager, self._eager_add = self._short_whole, self._short_whole_add
        else:
            self._eager, self._eager_add = self._short_trimmed, self._short_trimmed_add

    def _operators(self, x: torch.Tensor) -> torch.Tensor:
        """The product through PyTorch's operators, at any number of rows: a pass of `_dense_rows`
        rows or more (a CPU prefill chunk) one dense product over the widened weight where it has
        one, else the format's kernel (`_kernel_rows`)."""
        x2 = x.reshape(-1, self.in_features)
        dense = None
        if x2.shape[0] >= self._dense_rows:
            dense = self.held if self.holding else self.widened(dense_dtype(x2.dtype, self.bf16_pays))
        if dense is not None:
            y = torch.nn.functional.linear(x2.to(dense.dtype), dense).to(x2.dtype)
        else:
            y = self._kernel_rows(x2)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]  # tinygemm pads the output width
        bias = self._parameters.get("bias")
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _operators_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self._operators(x)

    def _int8_rows(self, x2: torch.Tensor) -> torch.Tensor:
        return self._mm(x2.contiguous(), self._buffers["qdata"], self._buffers["scale"])

    def _int4_rows(self, x2: torch.Tensor) -> torch.Tensor:
        if self.packed_in != self.in_features:  # CUDA's tile layout: zero columns up to the packed width
            x2 = torch.nn.functional.pad(x2, (0, self.packed_in - self.in_features))
        return self._mm(x2.contiguous(), self._buffers["qdata"], self.group,
                        self._scales(self._buffers["scale"]))  # tinygemm reads them as contiguous

    # Called 4 times a layer in every eager CPU pass: nothing is done that a pass does not need
    # (nn.Module.__getattr__ costs ~0.7 us a name: buffers and parameters are read from their dicts).
    def _short_whole(self, x: torch.Tensor) -> torch.Tensor:
        """The short product bound to the weight (its outputs the layer's, no bias): `_operators` for longer passes."""
        if x.numel() > self._short_numel:
            return self._long(x)
        return self._short(x.contiguous())  # [..., N]: a pass's product without reshapes (~2 us of its ~8)

    def _short_whole_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if x.numel() > self._short_numel:
            return residual + self._long(x)
        x = x.contiguous()
        if residual.is_contiguous() and residual.shape == (*x.shape[:-1], self.out_features):
            return self._short(x, residual)  # the add inside the kernel's call
        return residual + self._short(x)

    def _short_trimmed(self, x: torch.Tensor) -> torch.Tensor:
        """The short product bound to a weight whose outputs are padded past the layer's, or with a bias."""
        if x.numel() > self._short_numel:
            return self._long(x)
        y = self._short(x.contiguous())
        if self._short.n != self.out_features:
            y = y[..., : self.out_features]
        bias = self._parameters.get("bias")
        return y if bias is None else y + bias

    def _short_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """A long pass through the short product, MAX_ROWS rows a call (`_long` where the product
        says so: Bound.chunks), trimmed and biased as `_short_trimmed`."""
        x2 = x.reshape(-1, self.in_features).contiguous()
        step = cpu_packed_mm.MAX_ROWS
        y = torch.cat([self._short(x2[i : i + step]) for i in range(0, x2.shape[0], step)])
        if self._short.n != self.out_features:
            y = y[:, : self.out_features]
        bias = self._parameters.get("bias")
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _short_trimmed_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self._short_trimmed(x)

    def _scales(self, scale: torch.Tensor) -> torch.Tensor:
        """int4's scales as the kernels read them, contiguous: a layer fused with others (fuse_rows)
        views a column slice, copied once on its first own call through PyTorch's kernel
        (transformers' forward: bench's baselines, fidelity; its packed product reads the fused
        layer's scales: packed_cpu.bind_rows)."""
        if scale.is_contiguous():
            return scale
        if self._contiguous_scale is None:
            self._contiguous_scale = scale.contiguous()
        return self._contiguous_scale

    def _short_product(self, qdata: torch.Tensor, scale: torch.Tensor) -> cpu_packed_mm.Bound | None:
        """This layer's product for short CPU passes from viasd_kernels (cpu_packed_mm), bound to its
        weight, or None (PyTorch's kernel): the one `bind` chose, bound again first where `qdata` and
        `scale` (the layer's buffers, as model.py's layer fronts read them when they bind) are not
        the tensors it was bound to (a buffer replaced in place of `set_packed`). Passes do not call
        it: they call what was bound."""
        short = self._short
        if short is not None and (short.weights[0] is not qdata or short.weights[1] is not (
                scale if self.rows_of is not None else self._scales(scale))):
            self.bind()
            short = self._short
        return short

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.kind == "int4" or self.grouped else ""
        padded = f", packed_in={self.packed_in}" if self.packed_in != self.in_features else ""
        return f"{self.kind}, in={self.in_features}, out={self.out_features}{group}{padded}"


@contextlib.contextmanager
def widen_once(modules: list[torch.nn.Module], dtype: torch.dtype):
    """Within the block, every CPU int8/int4 layer in `modules` holds its weight widened to `dtype`
    (PackedLinear.widened), so the chunks of a long prefill, run layer by layer, widen each layer
    once instead of once a chunk. The products of one decoder layer are held at a time; they are
    dropped on leaving the block."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, PackedLinear)
              and not (m._short is not None and m._short.chunks)]  # those run a prefill in short chunks
    try:
        for m in layers:
            m.held, m.holding = m.widened(dense_dtype(dtype, m.bf16_pays)), True
        yield
    finally:
        for m in layers:
            m.held, m.holding = None, False
