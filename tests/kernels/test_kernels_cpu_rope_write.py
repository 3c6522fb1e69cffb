"""viasd_kernels.cpu_rope_write: RoPE on a pass's queries and keys and the cache writes, in one call.

Bit for bit the operators it replaces (`rope.apply_rope` on q and k, `LayerCache.update`) in float32
and bfloat16, for split views of a fused projection and for separate tensors, at slots in any order
(a token tree's), leaving every other slot alone; what it refuses; and FastModel's passes, every
family and format, bit for bit the same with the kernel and without it. A kernel that does not build
fails these tests under CI.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import FAMILIES, every_kind_of_pass, tiny_model
from viasd_kernels import cpu_flags, cpu_rope_write as rw

from viasd_core.runtime import weight_formats as wf
from viasd_core.runtime.attention import LayerCache
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.rope import apply_rope, signed_sin
from viasd_core.runtime.weight_format import WeightFormat

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels")
    cache = LayerCache(1, 4, 16, torch.float32, "cpu")
    if rw.bind(cache.k, cache.v, build_dir=path) is None:
        assert not os.environ.get("CI"), f"the RoPE kernel must build in CI: {rw.why_not()}"
        pytest.skip(f"the RoPE kernel cannot be built here: {rw.why_not()}")
    return path


def case(hq: int, hkv: int, d: int, T: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    fused = (torch.randn(1, T, (hq + 2 * hkv) * d, generator=g) * 4).to(dtype)
    angles = torch.rand(T, d // 2, generator=g) * 100
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    return fused, cos.to(dtype), signed_sin(sin).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 32), (8, 8, 128), (2, 1, 6)],
                         ids=lambda s: "Hq{}kv{}D{}".format(*s))
@pytest.mark.parametrize("T", [1, 5, 17])
def test_kernel_is_the_operators_bit_for_bit(build_dir, dtype, shape, T):
    hq, hkv, d = shape
    fused, cos, sin = case(hq, hkv, d, T, dtype, seed=T * d + hq)
    pos = torch.randperm(40, generator=torch.Generator().manual_seed(T))[:T]  # any slots, any order
    q, k, v = fused.split((hq * d, hkv * d, hkv * d), dim=-1)
    want_cache, got_cache = LayerCache(hkv, 40, d, dtype, "cpu"), LayerCache(hkv, 40, d, dtype, "cpu")
    for c in (want_cache, got_cache):  # slots already holding something
        c.k.copy_(torch.full_like(c.k, 0.5))
        c.v.copy_(torch.full_like(c.v, -0.5))
    want_q = apply_rope(q.view(1, T, hq, d).transpose(1, 2), cos, sin)
    want_cache.update(pos, apply_rope(k.view(1, T, hkv, d).transpose(1, 2), cos, sin),
                      v.view(1, T, hkv, d).transpose(1, 2))
    writer = rw.bind(got_cache.k, got_cache.v, build_dir=build_dir)
    def by_column(x):  # [T, W] laid out column by column, as the blocked float32 product returns it
        return x.contiguous()[0].t().contiguous().t()

    for qq, kk, vv in ((q, k, v), (q.contiguous()[0], k.contiguous()[0], v.contiguous()[0]),  # views, separate
                       (by_column(q), by_column(k), by_column(v))):
        got_cache.k.fill_(0.5)
        got_cache.v.fill_(-0.5)
        got_q = writer(qq, kk, vv, cos, sin, pos)
        assert got_q.shape == (1, hq, T, d) and got_q.dtype == dtype
        assert torch.equal(got_q, want_q)
        assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    got_cache.k.fill_(0.5)  # q, k and v read in place from the fused product's output
    got_cache.v.fill_(-0.5)
    assert torch.equal(writer.fused(fused, (hq * d, hkv * d, hkv * d), cos, sin, pos), want_q)
    assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)


def test_what_it_does_not_take_is_refused(build_dir):
    def caches(dtype=torch.float32, d=16):
        c = LayerCache(2, 8, d, dtype, "cpu")
        return c.k, c.v

    assert rw.bind(*caches(torch.float16), build_dir=build_dir) is None
    k, v = caches()
    assert rw.bind(k.transpose(2, 3), v.transpose(2, 3), build_dir=build_dir) is None  # not [1, Hkv, S, D] contiguous
    assert rw.bind(*caches(d=15), build_dir=build_dir) is None  # an odd head width
    assert rw.bind(k, v[:, :1].contiguous(), build_dir=build_dir) is None  # caches of two shapes
    writer = rw.bind(k, v, build_dir=build_dir)
    fused, cos, sin = case(4, 2, 16, 2, torch.float32, seed=1)
    q, kk, vv = fused.split((64, 32, 32), dim=-1)
    before = k.clone()
    assert writer(q.to(torch.bfloat16), kk, vv, cos, sin, torch.tensor([0, 1])) is None  # another dtype
    assert writer(q, kk[..., :16], vv, cos, sin, torch.tensor([0, 1])) is None  # not this cache's heads
    assert writer.fused(fused, (64, 16, 48), cos, sin, torch.tensor([0, 1])) is None  # not this cache's heads
    assert writer.fused(fused, (64, 32, 16), cos, sin, torch.tensor([0, 1])) is None  # widths not the output's
    assert writer.fused(fused[..., :-1], (64, 32, 31), cos, sin, torch.tensor([0, 1])) is None  # rows not contiguous
    assert writer.fused(fused.to(torch.bfloat16), (64, 32, 32), cos, sin, torch.tensor([0, 1])) is None
    assert torch.equal(k, before)  # nothing written
    int32 = writer(q, kk, vv, cos, sin, torch.tensor([0, 1], dtype=torch.int32))  # slots of another integer type
    assert torch.equal(int32, writer(q, kk, vv, cos, sin, torch.tensor([0, 1])))
    before = k.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        writer(q, kk, vv, cos, sin, torch.tensor([3, 8]))
    assert torch.equal(k, before)  # nothing written


def test_no_compiler_means_no_kernel_and_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_flags, "compiler", lambda: None)
    c = LayerCache(1, 4, 16, torch.float32, "cpu")
    assert rw.bind(c.k, c.v, build_dir=tmp_path / "none") is None
    assert "no C compiler" in rw.why_not()


@pytest.mark.parametrize("fmt", ["none", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_passes_are_bit_for_bit_with_and_without_the_kernel(build_dir, monkeypatch, family, fmt):
    monkeypatch.setattr("viasd_core.paths.kernel_dir", lambda: build_dir)
    model = tiny_model(family, seed=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32)
    if fmt != "none":
        model = wf.packed_copy(model, WeightFormat.parse(fmt))
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(4))
    fast = FastModel(model, max_len=64)
    calls = []
    real = rw.RopeWriter._run  # what the call and `fused` (a fused q/k/v product's output) both run
    monkeypatch.setattr(rw.RopeWriter, "_run", lambda self, *a: calls.append(1) or real(self, *a))
    with_kernel = every_kind_of_pass(fast, ids)
    assert calls or family == "qwen3"  # Qwen3's per-head norms keep the operators
    fast.bind_kernels(rope_kernel=False)
    assert all(k.writer is None for k in fast.cache.kernels)
    fast.reset()
    assert torch.equal(with_kernel, every_kind_of_pass(fast, ids))
