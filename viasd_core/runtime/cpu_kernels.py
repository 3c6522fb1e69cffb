"""viasd_kernels' C kernels as viasd_core calls them: the one place that names their build folder.

Each kernel module of `viasd_kernels` takes the folder it builds into (`build_dir`); viasd builds
them in `paths.kernel_dir()` (under the cache: one build per machine, instruction-set class and
source). The passes, the products' binding and doctor's descriptions call the kernels through
these functions, so the folder is looked up here, at call time (a test may point
`viasd_core.paths.kernel_dir` elsewhere), and nowhere else. Each returns what its kernel module
returns: a bound call, or None where the kernel does not take the tensors or cannot be built here
(the module's `why_not()` says why).
"""

from __future__ import annotations

from pathlib import Path

import torch
from viasd_kernels import cpu_f32_mm, cpu_int4_widen, cpu_layer, cpu_packed_mm, cpu_rms_norm, cpu_rope_write
from viasd_kernels import cpu_row_attention

from viasd_core import paths

# Whether the int8/int4 short-pass products bind the portable way where the AVX-512 BF16 way builds
# too: the machine's choice (machine/packed_way.py), handed over by the loader as it loads an int
# format (loading/models.py), as it records the bfloat16 verdict on the model; the runtime never asks
# the machine wing. Until then, the BF16 way where it builds.
_portable = False


def use_packed_way(portable: bool) -> None:
    """The way the packed products bind from now on (layers bound before keep theirs)."""
    global _portable
    _portable = bool(portable)


def folder() -> Path:
    """Where the kernels are built for this machine."""
    return paths.kernel_dir()


def rms_norm(weight: torch.Tensor, eps: float):
    return cpu_rms_norm.bind(weight, eps, build_dir=folder())


def f32_mm(weight: torch.Tensor, bias: torch.Tensor | None = None):
    return cpu_f32_mm.bind(weight, bias, build_dir=folder())


def f32_mm_vector_bits() -> int:
    return cpu_f32_mm.vector_bits(folder())


def row_attention(q, k, v, end: int, window=None, scale=None, key_mask=None, build_dir: Path | None = None):
    """`build_dir`: the folder a pass looked up once for its layers (else looked up now)."""
    return cpu_row_attention.row_attention(q, k, v, end, window, scale, key_mask, build_dir=build_dir or folder())


def rope_write(k: torch.Tensor, v: torch.Tensor):
    return cpu_rope_write.bind(k, v, build_dir=folder())


def layer_front(*args):
    """cpu_layer.bind over a layer's norms, products, RoPE writer and attention's shape."""
    return cpu_layer.bind(*args, build_dir=folder())


def layer_front_f32(*args):
    """cpu_layer.bind_f32 over a float32 layer's norms, seven products, RoPE writer and attention's shape."""
    return cpu_layer.bind_f32(*args, build_dir=folder())


def int4_widen(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor, block: int):
    return cpu_int4_widen.widen(qdata, group, scale_and_zero, block, build_dir=folder())


def int4_mm(qdata: torch.Tensor, group: int, scale: torch.Tensor, block: int | None):
    """In the way handed over (`use_packed_way`)."""
    return cpu_packed_mm.bind_int4(qdata, group, scale, block, build_dir=folder(), portable=_portable)


def int8_mm(qdata: torch.Tensor, scale: torch.Tensor):
    return cpu_packed_mm.bind_int8(qdata, scale, build_dir=folder(), portable=_portable)


def int8g_mm(qdata: torch.Tensor, scales: torch.Tensor):
    return cpu_packed_mm.bind_int8g(qdata, scales, build_dir=folder(), portable=_portable)


def packed_mm_way() -> str | None:
    """Which way the packed products run here (cpu_packed_mm.way, as handed over; and the int4
    products' where they run another, cpu_packed_mm.int4_way), None where they do not."""
    way, int4 = cpu_packed_mm.way(folder(), _portable), cpu_packed_mm.int4_way(folder(), _portable)
    return way if int4 == way else f"int4: {int4}; int8: {way}"


def packed_mm_why_not() -> str | None:
    return cpu_packed_mm.why_not(folder())
