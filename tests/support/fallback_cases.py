"""A pretend GPU whose Triton cannot run, shared by the kernels' fallback tests (a helper module,
not a test file)."""

from __future__ import annotations

import torch


def pretend_cuda_without_a_c_compiler(monkeypatch, kernel: str) -> None:
    """Every tensor claims CUDA, triton imports and has not failed yet, and viasd_kernels' Triton
    entry point `kernel` fails as triton does on a machine with no C compiler."""
    import viasd_kernels as vk

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(vk, "_triton_failed", False)
    monkeypatch.setattr(vk, "triton_available", lambda: True)
    monkeypatch.setattr(vk, kernel, no_compiler)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
