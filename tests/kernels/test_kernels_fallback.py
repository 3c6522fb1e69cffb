"""When route_block leaves the Triton kernel for its plain reference: only when Triton cannot run
here (no compiler, no driver, no backend...), once, with one warning; a real kernel bug raises.
Every case runs on CPU against a pretend GPU (the Triton path is replaced by a function that fails)."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from support.fallback_cases import pretend_cuda_without_a_c_compiler


def test_route_block_falls_back_to_the_reference_when_triton_cannot_run(monkeypatch):
    """A GPU without a C compiler (or any Triton failure) degrades to the reference, with one warning."""
    import viasd_kernels as vk

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    draft = torch.tensor([1, 2, 3])
    want = vk.route_block_reference(logits, draft, 0.0, 0.9, 0.5)

    pretend_cuda_without_a_c_compiler(monkeypatch, "route_block_triton")
    with pytest.warns(UserWarning, match="Triton routing kernel is unavailable"):
        got = vk.route_block(logits, draft, 0.0, 0.9, 0.5)
    assert vk._triton_failed
    again = vk.route_block(logits, draft, 0.0, 0.9, 0.5)  # no second try, no second warning
    monkeypatch.undo()
    for a, b, c in zip(got, want, again):
        assert torch.equal(a, b) and torch.equal(c, b)


def _route_with_failing_triton(monkeypatch, error: Exception):
    """route_block on a pretend GPU whose Triton path raises `error`; returns (result, reference)."""
    import viasd_kernels as vk

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    draft = torch.tensor([1, 2, 3])
    want = vk.route_block_reference(logits, draft, 0.0, 0.9, 0.5)

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(vk, "_triton_failed", False)
    monkeypatch.setattr(vk, "triton_available", lambda: True)
    monkeypatch.setattr(vk, "route_block_triton", failing)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return lambda: vk.route_block(logits, draft, 0.0, 0.9, 0.5), want


CANNOT_RUN = [
    ImportError("No module named 'triton'"),
    ModuleNotFoundError("No module named 'triton.backends.nvidia'"),
    subprocess.CalledProcessError(1, ["gcc", "cuda_utils.c"]),  # no Python headers for the launcher
    RuntimeError("Failed to find C compiler. Please specify via CC environment variable."),
    RuntimeError("0 active drivers ([]). There should only be one."),
    RuntimeError("0 compatible backends for target (cuda) ([]). There should only be one."),
    RuntimeError("Triton Error [CUDA]: no kernel image is available for execution on the device"),
    RuntimeError("Triton Error [CUDA]: the provided PTX was compiled with an unsupported PTX version"),
]


@pytest.mark.parametrize("error", CANNOT_RUN, ids=lambda e: f"{type(e).__name__}:{str(e)[:24]}")
def test_route_block_falls_back_when_triton_cannot_run_here(monkeypatch, error):
    import viasd_kernels as vk

    route, want = _route_with_failing_triton(monkeypatch, error)
    assert vk.cannot_run_here(error)
    with pytest.warns(UserWarning, match="Triton routing kernel is unavailable") as said:
        got = route()
        again = route()  # no second try, no second warning
    assert len(said) == 1 and type(error).__name__ in str(said[0].message)
    assert vk._triton_failed
    for a, b, c in zip(got, want, again):
        assert torch.equal(a, b) and torch.equal(c, b)


def test_route_block_falls_back_on_tritons_own_cannot_run_errors(monkeypatch):
    pytest.importorskip("triton")
    import ast

    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    import viasd_kernels as vk

    for error in (OutOfResources(232448, 101376, "shared memory"), CompilationError("x = 1", ast.parse("x = 1").body[0], "unsupported")):
        with pytest.MonkeyPatch.context() as mp:
            route, want = _route_with_failing_triton(mp, error)
            with pytest.warns(UserWarning, match="Triton routing kernel is unavailable"):
                got = route()
            assert vk._triton_failed and all(torch.equal(a, b) for a, b in zip(got, want))


BUGS = [
    IndexError("index 50 is out of bounds for dimension 0 with size 50"),
    ValueError("block_v must be a power of two"),
    RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
    TypeError("route_block_triton() got an unexpected keyword argument"),
]


@pytest.mark.parametrize("error", BUGS, ids=lambda e: type(e).__name__)
def test_route_block_raises_a_real_kernel_bug(monkeypatch, error):
    """A bug in the kernel or its inputs surfaces: no fallback, no warning, the next call tries again."""
    import warnings

    import viasd_kernels as vk

    route, _ = _route_with_failing_triton(monkeypatch, error)
    assert not vk.cannot_run_here(error)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning would fail the test
        for _ in range(2):
            with pytest.raises(type(error), match=re.escape(str(error))):
                route()
    assert not vk._triton_failed
