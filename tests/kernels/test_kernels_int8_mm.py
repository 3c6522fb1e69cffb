"""int8 weight-only matmul (viasd_kernels.int8_mm, the CUDA path of `--quant int8`): the Triton
kernel against float64 maths and its plain reference, no widened copy of the weight per call (the
reference makes one: the check sees it), the dispatch, torch.compile through the custom op, and
PackedLinear's int8 layers on a pretend GPU calling the kernel.

Without CUDA the kernel runs in the Triton interpreter on CPU tensors: this module sets
TRITON_INTERPRET=1 at import, before anything imports triton (as tests/kernels/test_kernels_routing.py
does), and fails if triton was imported earlier without it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import viasd_kernels as vk
from support.fallback_cases import pretend_cuda_without_a_c_compiler

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if HAS_CUDA else "cpu"
# (M, N, K): one row; a tail in N and K; a full 16-row tile; 17 and 70 rows (64-row tiles)
SHAPES = [(1, 96, 128), (3, 100, 200), (16, 64, 256), (17, 40, 96), (70, 33, 130)]
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}  # a unit in the last place, relative (at most)


@pytest.fixture(scope="module")
def fused():
    """The kernel: compiled on CUDA, else in the Triton interpreter."""
    triton = pytest.importorskip("triton")
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.sigmoid, InterpretedFunction):
            pytest.fail("no CUDA and triton is not in interpreter mode: run TRITON_INTERPRET=1 pytest "
                        "tests/kernels/test_kernels_int8_mm.py")
    return vk.int8_mm_triton


def operands(M, N, K, dtype, seed, sparse=False):
    """x [M, K], an int8 weight [N, K] and per-row scales [N]. sparse: x in {-1, 0, 1} (mostly 0),
    weights in [-8, 8] and power-of-two scales, so that every output is exact in the output dtype."""
    g = torch.Generator().manual_seed(seed)
    if sparse:
        x = torch.randint(-1, 2, (M, K), generator=g) * (torch.rand(M, K, generator=g) < 0.15)
        scale = 2.0 ** torch.randint(-6, 2, (N,), generator=g)
        w = torch.randint(-8, 9, (N, K), generator=g, dtype=torch.int8)
    else:
        x = torch.randn(M, K, generator=g)
        scale = torch.rand(N, generator=g) / 50 + 1e-3
        w = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    return x.to(dtype).to(DEVICE), w.to(DEVICE), scale.to(dtype).to(DEVICE)


def exact(x, w, scale) -> torch.Tensor:
    return (x.double() @ w.double().T) * scale.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M, N, K", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_kernel_is_exact_where_the_output_dtype_holds_the_result(fused, M, N, K, dtype):
    """Exactly representable results come out exactly: a wrong index, mask or tail shows."""
    x, w, scale = operands(M, N, K, dtype, seed=M * N + K, sparse=True)
    want = exact(x, w, scale)
    assert torch.equal(want.to(dtype).double(), want)  # the data's premise
    got = fused(x, w, scale)
    assert got.dtype == dtype and got.shape == (M, N)
    assert torch.equal(got.double(), want)
    assert torch.equal(vk.int8_mm_reference(x, w, scale).double(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M, N, K", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_kernel_is_within_one_unit_of_float64_and_close_to_the_reference(fused, M, N, K, dtype):
    x, w, scale = operands(M, N, K, dtype, seed=M + N + K)
    want = exact(x, w, scale)
    got, ref = fused(x, w, scale).double(), vk.int8_mm_reference(x, w, scale).double()
    # float32 accumulation may add up to about K * 2^-24 of the absolute sum (cancellations)
    slack = 2**-20 * ((x.double().abs() @ w.double().abs().T) * scale.double()).max()
    assert ((got - want).abs() <= ULP[dtype] * want.abs() + slack).all()
    assert ((got - ref).abs() <= 3 * ULP[dtype] * want.abs() + slack).all()  # the reference rounds twice


def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it(fused):
    """Up to 16 rows are one tile: a 1-token pass and a verify block compute a row alike."""
    x, w, scale = operands(16, 200, 300, torch.bfloat16, seed=3)
    block = fused(x, w, scale)
    for i in (0, 5, 15):
        assert torch.equal(fused(x[i : i + 1], w, scale)[0], block[i])
    assert torch.equal(fused(x[:7], w, scale), block[:7])


class WeightCopies(TorchDispatchMode):
    """Records every op that makes a floating-point tensor as large as the weight (a widened copy)."""

    def __init__(self, weight_numel: int):
        super().__init__()
        self.weight_numel, self.copies = weight_numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= self.weight_numel:
                self.copies.append(str(func))
        return out


def test_the_kernel_makes_no_copy_of_the_weight_and_the_reference_does(fused):
    x, w, scale = operands(4, 256, 512, torch.bfloat16, seed=4)
    with WeightCopies(w.numel()) as kernel_ops:
        fused(x, w, scale)
    with WeightCopies(w.numel()) as reference_ops:
        vk.int8_mm_reference(x, w, scale)
    assert kernel_ops.copies == []
    assert reference_ops.copies  # the check sees a widened copy when there is one


def pretend_gpu(monkeypatch) -> None:
    """Without CUDA, CPU tensors that say they are on CUDA: the CUDA dispatch runs, the kernel in
    the interpreter."""
    if not HAS_CUDA:
        monkeypatch.setattr(vk, "_triton_failed", False)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


def test_int8_mm_runs_the_reference_on_cpu_and_the_kernel_on_cuda(fused, monkeypatch):
    x, w, scale = operands(5, 48, 160, torch.bfloat16, seed=5)
    if not HAS_CUDA:
        assert torch.equal(vk.int8_mm(x, w, scale), vk.int8_mm_reference(x, w, scale))
    want = fused(x, w, scale)
    pretend_gpu(monkeypatch)
    assert torch.equal(vk.int8_mm(x, w, scale), want)


def test_int8_mm_falls_back_to_the_reference_once_triton_cannot_run(monkeypatch):
    x, w, scale = operands(2, 32, 64, torch.bfloat16, seed=6)

    pretend_cuda_without_a_c_compiler(monkeypatch, "int8_mm_triton")
    with pytest.warns(UserWarning, match="Triton int8 matmul kernel is unavailable"):
        got = vk.int8_mm(x, w, scale)
    assert vk._triton_failed
    monkeypatch.undo()
    assert torch.equal(got, vk.int8_mm_reference(x, w, scale))


def test_int8_mm_compiles_in_a_full_graph():
    """What the compiled CUDA pass needs: dynamo traces the custom op (its fake gives the shape)."""
    x, w, scale = operands(3, 40, 64, torch.bfloat16, seed=7)

    def layer(x):
        return torch.relu(vk.int8_mm(x, w, scale)) + 1

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), layer(x))


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_packed_int8_layers_on_cuda_call_the_kernel_without_a_weight_copy(fused, monkeypatch):
    """PackedLinear's int8 layer on CUDA: the kernel's numbers (equal to the plain reference within
    a unit), no widened copy of the weight, a bias added after."""
    from viasd_core.runtime.weight_format import WeightFormat
    from viasd_core.runtime.weight_formats import PackedLinear, apply_weight_format

    torch.manual_seed(8)
    holder = torch.nn.Sequential(torch.nn.Linear(192, 80, bias=True).to(torch.bfloat16).to(DEVICE))
    apply_weight_format(holder, WeightFormat.parse("int8"))
    layer = holder[0]
    assert isinstance(layer, PackedLinear) and layer.kind == "int8"
    x = torch.randn(2, 3, 192, dtype=torch.bfloat16, device=DEVICE)
    pretend_gpu(monkeypatch)
    layer.bind(packed_kernel=False)  # its products chosen again, as on a GPU: no CPU product, the CUDA int8 matmul
    with WeightCopies(layer.qdata.numel()) as ops:
        got = layer(x)
    assert ops.copies == []
    assert got.shape == (2, 3, 80)
    flat = x.reshape(-1, 192)
    assert torch.equal(got.reshape(-1, 80), fused(flat, layer.qdata, layer.scale) + layer.bias)
    ref = (vk.int8_mm_reference(flat, layer.qdata, layer.scale) + layer.bias).double()
    assert ((got.reshape(-1, 80).double() - ref).abs() <= 4 * ULP[torch.bfloat16] * ref.abs() + 1e-2).all()


def test_a_second_import_of_the_folder_leaves_the_op_to_viasd_kernels(monkeypatch):
    """Run from a source checkout, transformers' probe for the hub's `kernels` package imports the
    repository's kernels/ folder as `kernels`. That copy must not take the op over: calls keep going
    through viasd_kernels' dispatch (here: its fallback state, patched)."""
    import pathlib
    import sys

    folder = pathlib.Path(vk.__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("kernels_alias", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    alias = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kernels_alias", alias)
    spec.loader.exec_module(alias)
    assert alias.int8_mm is not None and alias is not vk

    calls = []
    monkeypatch.setattr(vk, "run_fused", lambda *args: calls.append(args[0]) or vk.int8_mm_reference(*args[4:]))
    x, w, scale = operands(2, 32, 64, torch.bfloat16, seed=8)
    got = torch.ops.viasd.int8_mm(x, w, scale)
    assert calls == ["int8 matmul"]
    assert torch.equal(got, vk.int8_mm_reference(x, w, scale))
