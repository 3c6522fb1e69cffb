"""A CPU's short passes over int4 and int8 weights: each weight read and widened once a pass.

PyTorch's CPU kernels for the int formats (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
widen the weight and multiply in float32 for every 4 rows of a pass, so a 6-token verify pass costs
about twice a 1-token pass (docs/experiments/short-pass-products-read-once.md). These kernels widen each weight once a
pass and multiply every row with it, one of two ways (cpu_packed_mm.c says how):

- **AVX-512 BF16** (`BF16_WAY`): the weight widened exactly to bfloat16, every row through the pair
  dot product `vdpbf16ps`; PyTorch's blocks of 64 outputs.
- **Portable** (`PORTABLE_WAY`), on every other CPU the C compiles for (AVX2 + FMA, AVX-512F
  without BF16, NEON, ...): the weight widened exactly to float32, every row through float32 fused
  multiply-adds; PyTorch's int4 blocks of 64 (its AVX-512 layout) or 32 (its AVX2 layout).

A row's arithmetic depends only on the row: the same in a pass of 1 or 16 rows and on any thread
count, so `sd` stays exact. The two ways round differently, so the numbers are one machine's (and
one instruction-set class's: VIASD_MAX_CPU_ISA picks the portable way on a CPU with BF16).

- **Kernels**: `bind_int4(qdata, group, scale_and_zero, block, build_dir=...)` and `bind_int8(qdata,
  scale, build_dir=...)` bind a layer's weight once and return its product (`Bound`: 1 to MAX_ROWS
  bfloat16 rows a call), and `bind_int8g(qdata, scales, build_dir=...)` an int8 weight with a float32
  scale for each group of 32 inputs (a GGUF file's Q8_0 blocks: the output head of `--quant gguf`),
  whose outputs are float32 (logits, not rounded to bfloat16); or None where the kernel does not take the weight or cannot be built here
  (no compiler), and the caller keeps PyTorch's kernels. Whether a layer takes it depends on the
  layer and the machine, never on a pass's width, so every pass of a layer takes the same kernel.
  `available(build_dir)`: whether either way runs; `way(build_dir)`: which; `why_not(build_dir)`:
  why the AVX-512 BF16 way does not (and why neither does, where the build failed).
- **References**: `int4_mm_reference`, `int8_mm_reference` and `int8g_mm_reference`, the same sums in float64 with
  PyTorch's ops (tests/kernels/test_kernels_cpu_packed_mm.py compares them, and checks rows bit for
  bit across pass widths and thread counts, each way, under each instruction-set cap);
  `int4_mm_portable_reference`, the portable way's int4 arithmetic bit for bit (the test compares
  every portable build with it, whatever its widening and tiling).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import cpu_build, cpu_int4_q8, instruction_set

SOURCE = Path(__file__).with_name("cpu_packed_mm.c")
MAX_ROWS, BLOCK, MAX_GROUP, MAX_K8 = 16, 64, 256, 8192  # the C file's limits (the AVX-512 BF16 way's)
GROUP8 = 32  # the inputs of a scale's group in bind_int8g's weights (GGUF's Q8_0 blocks)
PORTABLE_BLOCKS = (64, 32)  # the int4 layouts the portable way takes: PyTorch's AVX-512 and AVX2 blocks
BF16_WAY = "AVX-512 BF16 pair dot products"
PORTABLE_WAY = "float32 FMA over widened weights (portable)"
PORTABLE_NO_FMA_WAY = "float32 multiply-adds over widened weights (portable, no FMA)"  # a build without FMA
# The int4 products of the AVX2 class (AVX2 + FMA, no AVX-512): the rows quantized to int8 per group,
# times the 4-bit codes in integers (cpu_int4_q8.py), where the group is a multiple of 32; on
# 2026-12-02 on an AVX2-only EPYC (Zen 3) they made a 1-token int4 pass's products ~2.5x faster than
# the portable way's float32 ones (docs/experiments/avx2-int4-int8-activations.md). The AVX-512
# class keeps the portable way (16-lane float32: not measured against this on such a CPU).
Q8_CLASSES = ("avx2",)

_why_not: dict[Path, str] = {}
_ways: dict[Path, str] = {}


class _Way:
    """One build's products: `int4` by block, `int8`, and the K limit and multiple int8 takes."""

    __slots__ = ("name", "int4", "int8", "int8g", "k8_max", "k8_multiple", "int4_q8", "int8_q8")

    def __init__(self, name: str, int4: dict, int8, int8g, k8_max: int | None, k8_multiple: int,
                 int4_q8: dict | None = None, int8_q8=None):
        self.name, self.int4, self.int8, self.k8_max, self.k8_multiple = name, int4, int8, k8_max, k8_multiple
        self.int8g = int8g  # int8 with a float32 scale for each group of 32 inputs, float32 out (bind_int8g)
        self.int4_q8 = int4_q8  # {block: the int8-activation product} where the machine's class takes it
        self.int8_q8 = int8_q8  # the int8 weights' one, likewise


def _bf16_why_not() -> str:
    own = instruction_set.cpu_isa_class()
    if instruction_set.isa_class() != own and own == "avx512_bf16":
        return f"{instruction_set.ISA_ENV}={instruction_set.max_isa()} caps the instruction set below AVX-512 BF16"
    return "this CPU has no AVX-512 BF16 instructions"


def _functions_for(build_dir: Path, portable: bool = False) -> _Way | None:
    """The products this build runs: the AVX-512 BF16 way where it builds, else the portable one;
    `portable` True: the portable way even where the BF16 way builds (a machine that timed it faster:
    viasd_core/machine/packed_way.py)."""
    has = cpu_build.function(SOURCE, build_dir, "viasd_packed_mm_available")
    if has is None:
        _why_not[build_dir] = cpu_build.why_not(SOURCE) or "the kernel could not be built"
        return None
    bf16 = bool(has())
    if bf16 and not portable:
        _ways[build_dir] = BF16_WAY
        return _Way(BF16_WAY, {BLOCK: cpu_build.function(SOURCE, build_dir, "viasd_int4_mm")},
                    cpu_build.function(SOURCE, build_dir, "viasd_int8_mm"),
                    cpu_build.function(SOURCE, build_dir, "viasd_int8g_mm"), MAX_K8, 32)
    fused = cpu_build.function(SOURCE, build_dir, "viasd_packed_mm_fma")()
    name = PORTABLE_WAY if fused else PORTABLE_NO_FMA_WAY
    if not bf16:
        _why_not[build_dir] = _bf16_why_not()
        _ways[build_dir] = name
    q8 = cpu_int4_q8.functions(build_dir) if instruction_set.isa_class() in Q8_CLASSES else None
    return _Way(name, {b: cpu_build.function(SOURCE, build_dir, f"viasd_int4_mm_portable{b}") for b in PORTABLE_BLOCKS},
                cpu_build.function(SOURCE, build_dir, "viasd_int8_mm_portable"),
                cpu_build.function(SOURCE, build_dir, "viasd_int8g_mm_portable"), None, 16, q8,
                q8 and cpu_int4_q8.int8_function(build_dir))


def available(build_dir: Path) -> bool:
    """Whether the kernels run on this machine (built: the AVX-512 BF16 way or the portable one)."""
    return _functions_for(build_dir) is not None


def ways(build_dir: Path) -> tuple[str, ...]:
    """The ways the products can run here: (BF16_WAY, PORTABLE_WAY) where the BF16 way builds (the
    portable one is built beside it), the portable way alone elsewhere, () where nothing builds."""
    fns = _functions_for(build_dir)
    if fns is None:
        return ()
    return (BF16_WAY, _functions_for(build_dir, portable=True).name) if fns.name == BF16_WAY else (fns.name,)


def way(build_dir: Path, portable: bool = False) -> str | None:
    """Which way the products run here (BF16_WAY or PORTABLE_WAY; `portable`: as bound with it), None
    where neither does."""
    fns = _functions_for(build_dir, portable)
    return fns and fns.name


def int4_way(build_dir: Path, portable: bool = False) -> str | None:
    """Which way the int4 products of groups of 32 run here: `way`, or cpu_int4_q8.WAY where the
    machine's class takes the int8-activation products (Q8_CLASSES)."""
    fns = _functions_for(build_dir, portable)
    return fns and (cpu_int4_q8.WAY if fns.int4_q8 is not None else fns.name)


def why_not(build_dir: Path) -> str | None:
    """Why the AVX-512 BF16 way does not run here (the portable one does instead), or why no way
    does (the build failed); None where the BF16 way runs, or nothing was tried yet."""
    return _why_not.get(build_dir)


class Bound:
    """One layer's short-pass product, bound once to its weight: `bound(x)` for x [..., K] bfloat16,
    contiguous, on the CPU, of 1 to MAX_ROWS rows -> [..., N] bfloat16 (`out_dtype`: float32 for
    bind_int8g's products). A pass calls it for every
    layer, so it checks what it hands the kernel in one expression (~0.4 us), allocates the output
    and calls the kernel; `weights` are the layer's tensors it was bound to (the caller binds again
    if they are replaced; a weight whose storage was replaced in place, `.data =`, is bound again
    here, or refused where the kernel does not take it), `reads` what the kernel reads (the weights,
    or copies of them laid out for it)."""

    __slots__ = ("fn", "weights", "reads", "ptrs", "sources", "n", "k", "tail", "block", "k8", "chunks", "out_dtype")

    def __init__(self, fn, weights: tuple[torch.Tensor, torch.Tensor], tail: tuple[int, ...],
                 reads: tuple[torch.Tensor, torch.Tensor] | None = None, block: int | None = None,
                 k8: tuple[int | None, int] = (MAX_K8, 32), chunks: bool = False,
                 out_dtype: torch.dtype = torch.bfloat16):
        self.fn, self.weights, self.tail, self.block, self.k8 = fn, weights, tail, block, k8
        self.out_dtype = out_dtype
        # whether longer passes (prefill chunks) run through it too, MAX_ROWS rows a call, rather than
        # one dense product over the widened weight (the int8-activation products: bind_int4)
        self.chunks = chunks
        self.reads = weights if reads is None else reads
        self.ptrs = tuple(w.data_ptr() for w in self.reads)
        self.sources = tuple(w.data_ptr() for w in weights)  # where the weights were when bound
        self.n = weights[0].shape[0]
        self.k = weights[0].shape[1] * (2 if weights[0].dtype == torch.uint8 else 1)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] (`out_dtype`); with `residual` ([..., N] `out_dtype`, contiguous)
        `residual + x W^T` in the same call, bit for bit PyTorch's add of the two (the product rounded
        first)."""
        if x.dtype is not torch.bfloat16 or not x.is_cpu or x.shape[-1] != self.k or not x.is_contiguous():
            raise ValueError(f"the packed product takes contiguous bfloat16 rows of {self.k} inputs on the CPU, "
                             f"not {tuple(x.shape)} {x.dtype} on {x.device}"
                             + ("" if x.is_contiguous() else f" with strides {x.stride()}"))
        w = self.weights
        if w[0].data_ptr() != self.sources[0] or w[1].data_ptr() != self.sources[1]:
            self.check()
        m = x.numel() // self.k
        out = torch.empty(*x.shape[:-1], self.n, dtype=self.out_dtype)
        if residual is not None and (residual.shape != out.shape or residual.dtype is not self.out_dtype
                                     or not residual.is_cpu or not residual.is_contiguous()):
            raise ValueError(f"the packed product's residual must be {tuple(out.shape)} {self.out_dtype}, contiguous, "
                             f"on the CPU, not {tuple(residual.shape)} {residual.dtype} on {residual.device}")
        rc = self.fn(x.data_ptr(), *self.ptrs, m, self.n, self.k, *self.tail, out.data_ptr(),
                     None if residual is None else residual.data_ptr(), torch.get_num_threads())
        if rc != 0:
            why = "out of memory" if rc == -3 else f"arguments it does not take (code {rc})"
            raise ValueError(f"the packed product failed: {why}: x {tuple(x.shape)}, weight {tuple(self.weights[0].shape)}")
        return out

    def check(self) -> None:
        """Binds the weights again where their storage moved (`.data =`: what the kernel read was
        freed), laying them out again; ValueError where the kernel does not take them now."""
        qdata, scale = self.weights
        if (qdata.data_ptr(), scale.data_ptr()) == self.sources:
            return
        int4 = qdata.dtype == torch.uint8
        if int4:
            takes = _takes_int4(qdata, self.tail[0], scale, self.block, (self.block,))
        elif self.out_dtype is torch.float32:
            takes = _takes_int8g(qdata, scale, self.k8[0])
        else:
            takes = _takes_int8(qdata, scale, self.k8)
        if not takes or qdata.shape[0] != self.n:
            raise ValueError(f"the packed product's weight was replaced by {tuple(qdata.shape)} {qdata.dtype} "
                             f"(scales {tuple(scale.shape)}) on {qdata.device}, which it does not take: bind it again")
        self.reads = (qdata, scales_by_block(scale, self.block)) if int4 else (qdata, scale)
        self.ptrs = tuple(w.data_ptr() for w in self.reads)
        self.sources = (qdata.data_ptr(), scale.data_ptr())


def _takes_int4(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int | None,
                blocks: tuple[int, ...] = (BLOCK,)) -> bool:
    n, k = qdata.shape[0], qdata.shape[1] * 2 if qdata.dim() == 2 else -1
    return (qdata.device.type == "cpu" and qdata.dtype == torch.uint8 and qdata.dim() == 2 and qdata.is_contiguous()
            and block in blocks and n % block == 0 and 0 < group <= MAX_GROUP and group % 2 == 0 and k % group == 0
            and scale_and_zero.device.type == "cpu" and scale_and_zero.dtype == torch.bfloat16
            and scale_and_zero.is_contiguous() and tuple(scale_and_zero.shape) == (k // group, n, 2))


def _takes_int8(qdata: torch.Tensor, scale: torch.Tensor, k8: tuple[int | None, int] = (MAX_K8, 32)) -> bool:
    most, multiple = k8
    return (qdata.device.type == "cpu" and qdata.dtype == torch.int8 and qdata.dim() == 2 and qdata.is_contiguous()
            and qdata.shape[1] % multiple == 0 and qdata.shape[1] > 0 and (most is None or qdata.shape[1] <= most)
            and scale.device.type == "cpu" and scale.dtype == torch.bfloat16 and scale.is_contiguous()
            and tuple(scale.shape) == (qdata.shape[0],))


def _takes_int8g(qdata: torch.Tensor, scales: torch.Tensor, most: int | None) -> bool:
    return (qdata.device.type == "cpu" and qdata.dtype == torch.int8 and qdata.dim() == 2 and qdata.is_contiguous()
            and qdata.shape[1] % GROUP8 == 0 and qdata.shape[1] > 0 and (most is None or qdata.shape[1] <= most)
            and scales.device.type == "cpu" and scales.dtype == torch.float32 and scales.is_contiguous()
            and tuple(scales.shape) == (qdata.shape[0], qdata.shape[1] // GROUP8))


def bind_int4(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int | None, *,
              build_dir: Path, int8_activations: bool = True, portable: bool = False) -> Bound | None:
    """The short-pass product of a CPU int4 weight (qdata [N, K / 2] uint8 in PyTorch's layout with
    blocks of `block` outputs, scale_and_zero [K / group, N, 2] bfloat16, contiguous), or None where
    the kernel does not take it or cannot run here: the AVX-512 BF16 way takes blocks of 64, the
    portable way blocks of 64 and 32 (PyTorch's AVX-512 and AVX2 layouts; None, a layout that is
    neither, is refused). The kernel reads a copy of the scales laid out block by block
    (`scales_by_block`: K * N * 4 / group bytes more, a quarter of the weight's at group 32), which a
    1-token pass streams instead of missing on one every group (cpu_packed_mm.c). Where the machine's
    class takes them (Q8_CLASSES) and the group is a multiple of 32, the int8-activation products
    (cpu_int4_q8.py); `int8_activations` False: the portable way's float32 products there too (the
    tests' and the A/B benchmarks' other side); a prefill's chunks then run through them too, 16
    rows a call (`Bound.chunks`: on that CPU faster than widening the weight to float32 for one
    dense product, and every row's numbers the short passes'). `portable`: the portable way where the
    BF16 way builds too (`_functions_for`)."""
    fns = _functions_for(build_dir, portable) if block in PORTABLE_BLOCKS else None
    if fns is None or not _takes_int4(qdata, group, scale_and_zero, block, tuple(fns.int4)):
        return None
    q8 = int8_activations and fns.int4_q8 is not None and group % cpu_int4_q8.CHUNK == 0
    return Bound(fns.int4_q8[block] if q8 else fns.int4[block], (qdata, scale_and_zero), (group,),
                 (qdata, scales_by_block(scale_and_zero, block)), block=block, chunks=q8)


def scales_by_block(scale_and_zero: torch.Tensor, block: int) -> torch.Tensor:
    """PyTorch's int4 scales [K / group, N, 2] laid out as the kernel reads them: [N / block,
    K / group, block, 2], each block's groups one after another."""
    groups, n, _ = scale_and_zero.shape
    return scale_and_zero.view(groups, n // block, block, 2).permute(1, 0, 2, 3).contiguous()


def bind_int8(qdata: torch.Tensor, scale: torch.Tensor, *, build_dir: Path, int8_activations: bool = True,
              portable: bool = False) -> Bound | None:
    """The short-pass product of an int8 weight qdata [N, K] with a bfloat16 scale per output, or None
    where the kernel does not take it or cannot run here (the AVX-512 BF16 way takes K a multiple of
    32 up to MAX_K8, the portable way any multiple of 16). Where the machine's class takes them
    (Q8_CLASSES) and K is a multiple of 32, the product over int8 activations (cpu_int4_q8.py), whose
    prefill chunks run through it too (`Bound.chunks`); `int8_activations` False: the portable way;
    `portable`: the portable way where the BF16 way builds too."""
    fns = _functions_for(build_dir, portable) if qdata.dim() == 2 else None
    if fns is None or not _takes_int8(qdata, scale, (fns.k8_max, fns.k8_multiple)):
        return None
    q8 = int8_activations and fns.int8_q8 is not None and qdata.shape[1] % cpu_int4_q8.CHUNK == 0
    k8 = (fns.k8_max, cpu_int4_q8.CHUNK if q8 else fns.k8_multiple)
    return Bound(fns.int8_q8 if q8 else fns.int8, (qdata, scale), (), k8=k8, chunks=q8)


def bind_int8g(qdata: torch.Tensor, scales: torch.Tensor, *, build_dir: Path, portable: bool = False) -> Bound | None:
    """The short-pass product of an int8 weight qdata [N, K] with a float32 scale for each group of
    GROUP8 inputs (scales [N, K / GROUP8]: a GGUF file's Q8_0 blocks exactly), whose outputs are float32
    (the output head's logits: not rounded to bfloat16), or None where the kernel does not take it or
    cannot run here (K a multiple of 32; the AVX-512 BF16 way up to MAX_K8). Each group's sum over its
    inputs times the group's scale, added to the output group by group in order: the AVX-512 BF16 way
    through pair dot products, every other class the portable float32 one (the AVX2 class's int8
    activations are not used for it). `portable`: the portable way where the BF16 way builds too."""
    fns = _functions_for(build_dir, portable) if qdata.dim() == 2 else None
    if fns is None or fns.int8g is None or not _takes_int8g(qdata, scales, fns.k8_max):
        return None
    return Bound(fns.int8g, (qdata, scales), (), k8=(fns.k8_max, GROUP8), out_dtype=torch.float32)


def int4_mm_reference(x: torch.Tensor, codes: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """What `int4_mm` computes, in float64 before its one rounding, from the weight's 4-bit codes
    [N, K] (0..15, read back from the packed layout): for each output, over each group,
    scale * sum(x * (q - 8)) + zero * sum(x). [M, N] float64."""
    n, k = codes.shape
    q = (codes.double() - 8).view(n, k // group, group)
    scale, zero = scale_and_zero.double().permute(2, 1, 0)  # each [N, K / group]
    xg = x.double().view(x.shape[0], k // group, group)
    d = torch.einsum("mgk,ngk->mng", xg, q)
    return (d * scale + xg.sum(-1)[:, None, :] * zero).sum(-1)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma(a, b, c) of float32 tensors, rounded once to float32 (round to nearest, ties to even): the
    product is exact in float64; the float64 sum's rounding error (TwoSum) decides the one case where
    rounding the float64 sum again would not be the exact sum's rounding (it lands on a float32 tie)."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    v = s - p
    e = (p - (s - v)) + (c - v)  # exact: p + c = s + e
    r = s.float()
    up, down = torch.nextafter(r, r.new_tensor(float("inf"))), torch.nextafter(r, r.new_tensor(float("-inf")))
    mid_up, mid_down = (r.double() + up.double()) / 2, (r.double() + down.double()) / 2
    r = torch.where((s == mid_up) & (e != 0), torch.where(e > 0, up, r), r)
    return torch.where((s == mid_down) & (e != 0), torch.where(e < 0, down, r), r)


def int4_mm_portable_reference(x: torch.Tensor, codes: torch.Tensor, group: int, scale_and_zero: torch.Tensor,
                               fused: bool = True) -> torch.Tensor:
    """The portable way's int4 product bit for bit, with PyTorch's operators ([M, N] bfloat16), from
    the weight's 4-bit codes [N, K] (0..15): each output's D = fma(x[k], q[k] - 8, D) over each group
    in input order (the products are exact, so a float32 multiply then add), X = the group's float32
    sum of x in input order, y = fma(X, zero, fma(D, scale, y)) over the groups in order (`fused`
    False: each product rounded, a build without FMA), rounded once to bfloat16 (cpu_packed_mm.c,
    "The portable products"). The kernel's tiling and widening change none of these operations."""
    m, (n, k) = x.shape[0], codes.shape
    groups = k // group
    xf = x.float().view(m, groups, group)
    q = (codes.to(torch.int32) - 8).float().view(n, groups, group)
    d = torch.zeros(m, n, groups)
    xs = torch.zeros(m, groups)
    for i in range(group):  # every group's sequences side by side, each in input order
        d = d + xf[:, None, :, i] * q[None, :, :, i]
        xs = xs + xf[:, :, i]
    scale, zero = scale_and_zero.float().unbind(-1)  # each [K / group, N]
    y = torch.zeros(m, n)
    for g in range(groups):
        if fused:
            y = _fma32(xs[:, g : g + 1].expand(m, n), zero[g].expand(m, n), _fma32(d[:, :, g], scale[g].expand(m, n), y))
        else:
            y = y + d[:, :, g] * scale[g]
            y = y + xs[:, g : g + 1] * zero[g]
    return y.to(torch.bfloat16)


def int8_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `int8_mm` computes, in float64 before its one rounding. [M, N] float64."""
    return (x.double() @ qdata.double().t()) * scale.double()


def int8g_mm_reference(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `bind_int8g`'s product computes, in float64: for each output, the sum over its groups of
    GROUP8 inputs of scale * sum(x * q). [M, N] float64."""
    n, k = qdata.shape
    q = qdata.double().view(n, k // GROUP8, GROUP8)
    d = torch.einsum("mgk,ngk->mng", x.double().view(x.shape[0], k // GROUP8, GROUP8), q)
    return (d * scales.double()).sum(-1)
