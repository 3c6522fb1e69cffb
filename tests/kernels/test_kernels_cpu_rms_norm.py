"""viasd_kernels.cpu_rms_norm and viasd_core.runtime.norms: RMSNorm in one call on a CPU.

The kernel against transformers' formula (PyTorch's operators): float32 within float32 rounding,
bfloat16 within one rounding step and nearly always bit for bit (only the order of the sum of
squares differs); a row's result alone and among other rows bit for bit; what it refuses. Then
`norm_calls`: its eager call takes the kernel for transformers' RMSNorm and keeps the module's
forward where the formula differs (Gemma's `1 + weight`); its traced call is the module's forward.
A kernel that does not build fails these tests under CI.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from viasd_kernels import cpu_flags, cpu_rms_norm as rn

from viasd_core.runtime import norms


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels")
    if rn.bind(torch.ones(16), 1e-6, build_dir=path) is None:
        assert not os.environ.get("CI"), f"the RMSNorm kernel must build in CI: {rn.why_not()}"
        pytest.skip(f"the RMSNorm kernel cannot be built here: {rn.why_not()}")
    return path


def case(rows: int, h: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=g) * 2.0 ** torch.randint(-6, 7, (rows, 1), generator=g)
    return x.to(dtype), (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [16, 576, 2048])
def test_kernel_is_transformers_formula(build_dir, dtype, h):
    x, w = case(7, h, dtype, seed=h)
    norm = rn.bind(w, 1e-5, build_dir=build_dir)
    got, want = norm(x), rn.rms_norm_reference(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=0)
    else:  # at most one bfloat16 step apart, and nearly always the same value
        assert ((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs()).all()
        assert (got == want).float().mean() >= 0.99
    module = LlamaRMSNorm(h, eps=1e-5).to(dtype)
    module.weight.data = w
    with torch.no_grad():
        assert torch.equal(module(x), want)  # the reference is transformers' module, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_alone_and_among_others(build_dir, dtype):
    x, w = case(9, 576, dtype, seed=1)
    norm = rn.bind(w, 1e-6, build_dir=build_dir)
    together = norm(x.view(1, 9, 576))
    assert together.shape == (1, 9, 576)
    for i in range(9):
        assert torch.equal(norm(x[i : i + 1]), together[0, i : i + 1])


def test_what_it_does_not_take_is_refused(build_dir):
    assert rn.bind(torch.ones(24), 1e-6, build_dir=build_dir) is None  # width not a multiple of 16
    assert rn.bind(torch.ones(32, dtype=torch.float16), 1e-6, build_dir=build_dir) is None
    assert rn.bind(torch.ones(2, 16), 1e-6, build_dir=build_dir) is None
    norm = rn.bind(torch.ones(32), 1e-6, build_dir=build_dir)
    with pytest.raises(ValueError, match="bound to"):
        norm(torch.ones(2, 48))
    with pytest.raises(ValueError, match="bound to"):
        norm(torch.ones(2, 32, dtype=torch.bfloat16))


def test_no_compiler_means_no_kernel_and_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_flags, "compiler", lambda: None)
    assert rn.bind(torch.ones(16), 1e-6, build_dir=tmp_path / "none") is None
    assert "no C compiler" in rn.why_not()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_calls_take_the_kernel_for_transformers_rmsnorm(build_dir, monkeypatch, dtype):
    monkeypatch.setattr("viasd_core.paths.kernel_dir", lambda: build_dir)
    module = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    module.weight.data = case(1, 576, dtype, seed=2)[1]
    calls = []
    real = rn.Norm.__call__
    monkeypatch.setattr(rn.Norm, "__call__", lambda self, x: calls.append(x.shape) or real(self, x))
    bound = norms.norm_calls(module)
    call = bound.eager
    assert bound.kernel is call and bound.traced == module.forward
    calls.clear()
    x = case(5, 576, dtype, seed=3)[0]
    got = call(x)
    assert calls == [x.shape]
    with torch.no_grad():
        want = module(x)
    assert ((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs()).all()
    calls.clear()
    x_grad = x.clone().requires_grad_(True)  # the traced call (training's too) keeps autograd working
    assert bound.traced(x_grad).grad_fn is not None and calls == []


def test_norm_calls_keep_the_forward_of_another_formula(build_dir, monkeypatch):
    monkeypatch.setattr("viasd_core.paths.kernel_dir", lambda: build_dir)
    gemma = GemmaRMSNorm(576, eps=1e-6)  # (1 + weight) times the normalized row
    gemma.weight.data = 0.1 * torch.randn(576, generator=torch.Generator().manual_seed(4))
    assert norms.norm_calls(gemma).eager == gemma.forward
    layer_norm = torch.nn.LayerNorm(576)  # a weight and a float eps, but the mean subtracted
    assert norms.norm_calls(layer_norm).eager == layer_norm.forward
    llama = LlamaRMSNorm(576, eps=1e-6)
    assert norms.norm_calls(llama).eager != llama.forward


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_a_model_says_how_its_norms_and_rope_run(build_dir, monkeypatch, family):
    """What `viasd doctor` prints as `layer_kernels`: Llama's formula in one call, Gemma's norm through
    its module, Qwen3's RoPE through the operators (its per-head norms come first), and where a float32
    layer runs its calls up to the MLP in one C call."""
    from conftest import tiny_model

    from viasd_core.runtime.model import FastModel

    monkeypatch.setattr("viasd_core.paths.kernel_dir", lambda: build_dir)
    way = FastModel(tiny_model(family, seed=1), max_len=32).layer_kernels_way()
    norm, rope, *front = way.split("; ")
    assert norm == ("RMSNorm through the module (not the formula the kernel computes)" if family == "gemma"
                    else "RMSNorm in one C call")
    assert rope == ("RoPE through operators (per-head norms come first)" if family == "qwen3"
                    else "RoPE and cache writes in one C call")
    # float32 layers of the plain shape run their calls up to the MLP in one C call (not Qwen2's q/k/v
    # biases, Qwen3's per-head norms, Gemma's norm)
    assert front == ([] if family in ("qwen2", "qwen3", "gemma") else ["a float32 layer's calls up to its MLP in one C call"])
