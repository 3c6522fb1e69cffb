"""machine/packed_way.py: which way the int8/int4 short-pass products run where a CPU builds two.

The choice from timings (faked here: speed is measured by benchmarks, not tests), the one way of a
CPU that builds one, the pin and its one-line refusal, the stored verdict read back, and the choice
reaching the products a model binds (bit for bit the chosen way's reference). The suite pins the way
to 'bf16' (conftest.py); these tests unpin it.
"""

from __future__ import annotations

import pytest
import torch
from support.int4_cases import case, pack
from viasd_kernels import cpu_int4_q8 as q8, cpu_packed_mm as pm

from viasd_core.errors import UsageError
from viasd_core.machine import packed_way
from viasd_core.runtime import cpu_kernels

CPU = torch.device("cpu")
INT8 = (torch.randint(-127, 128, (64, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(1)),
        torch.full((64,), 0.01).to(torch.bfloat16))
BOTH = lambda: (pm.BF16_WAY, pm.PORTABLE_WAY)  # noqa: E731
bits = lambda t: t.view(torch.int16)  # noqa: E731


@pytest.fixture
def unpinned(monkeypatch, viasd_home):
    monkeypatch.delenv(packed_way.ENV, raising=False)
    packed_way.portable.cache_clear()
    yield
    packed_way.portable.cache_clear()


def test_the_portable_way_is_chosen_only_when_clearly_faster():
    timed = lambda bf16, portable: (lambda p: portable if p else bf16)  # noqa: E731
    faster = packed_way.measure(CPU, timed(0.0100, 0.0080), BOTH)
    assert faster == {"portable": True, "bf16_ms": 10.0, "portable_ms": 8.0}
    assert packed_way.measure(CPU, timed(0.0100, 0.0095), BOTH)["portable"]  # at the margin
    assert not packed_way.measure(CPU, timed(0.0100, 0.0096), BOTH)["portable"]  # within it: BF16 kept
    assert not packed_way.measure(CPU, timed(0.0080, 0.0100), BOTH)["portable"]


def test_a_cpu_that_builds_one_way_times_nothing():
    never = lambda p: pytest.fail("timed a CPU with one way")  # noqa: E731
    only = packed_way.measure(CPU, never, lambda: (pm.PORTABLE_WAY,))
    assert only == {"portable": True, "only": pm.PORTABLE_WAY}
    assert packed_way.shown(only) == ("portable", f"the one way that builds here ({pm.PORTABLE_WAY})")


def test_the_pin_decides_and_a_wrong_value_is_one_line(unpinned, monkeypatch):
    monkeypatch.setattr(packed_way, "measure", lambda device: pytest.fail("measured a pinned choice"))
    monkeypatch.setattr(pm, "ways", lambda folder: BOTH())  # a CPU that builds both ways
    monkeypatch.setenv(packed_way.ENV, "Portable")
    assert packed_way.verdict(CPU) == {"portable": True, "pinned": f"{packed_way.ENV}=portable"}
    assert packed_way.shown(packed_way.verdict(CPU)) == ("portable", f"pinned by {packed_way.ENV}=portable")
    monkeypatch.setenv(packed_way.ENV, "bf16")
    assert packed_way.verdict(CPU)["portable"] is False
    monkeypatch.setattr(pm, "ways", lambda folder: (pm.PORTABLE_WAY,))  # one way: a pin changes nothing, and says so
    assert packed_way.verdict(CPU) == {"portable": True, "only": pm.PORTABLE_WAY, "pinned": f"{packed_way.ENV}=bf16"}
    assert packed_way.shown(packed_way.verdict(CPU)) == (
        "portable", f"the one way that builds here ({pm.PORTABLE_WAY}); {packed_way.ENV}=bf16 changes nothing")
    monkeypatch.setenv(packed_way.ENV, "amx")
    with pytest.raises(UsageError, match=f"{packed_way.ENV}='amx' is not one of bf16, portable"):
        packed_way.verdict(CPU)


def test_the_verdict_is_measured_once_stored_and_read_back(unpinned, monkeypatch, viasd_home):
    calls = []
    monkeypatch.setattr(packed_way, "measure",
                        lambda device: calls.append(1) or {"portable": True, "bf16_ms": 3.3, "portable_ms": 2.6})
    assert packed_way.verdict(CPU)["portable"] and packed_way.portable()
    assert packed_way.verdict(CPU) == {"portable": True, "bf16_ms": 3.3, "portable_ms": 2.6} and len(calls) == 1
    assert list((viasd_home / "cache" / "machine").glob("packed-way-*.json"))
    monkeypatch.setattr(packed_way, "measure", lambda device: {"portable": False, "bf16_ms": 2.0, "portable_ms": 2.6})
    assert not packed_way.verdict(CPU, refresh=True)["portable"]
    assert not packed_way.portable()  # the per-process answer follows a refresh
    assert packed_way.verdict("meta") == {"portable": False}  # not a CPU: nothing to choose


@pytest.fixture
def handed_back():
    """cpu_kernels' way as the test found it, put back after (the loader hands a way over)."""
    before = cpu_kernels._portable
    yield
    cpu_kernels.use_packed_way(before)


@pytest.mark.parametrize("portable", [False, True], ids=["bf16", "portable"])
def test_the_runtime_binds_the_way_handed_over_bit_for_bit(handed_back, portable):
    """cpu_kernels binds the way it was handed, int4 and int8 alike: the portable way's products (its
    reference's bits) where handed the portable way, the BF16 way's where handed that and it builds
    (else the portable way: the one this CPU has). (On typical rows the two ways' bits agree: each
    group's sums are exact in float32; tests/kernels/test_kernels_cpu_packed_mm.py tells them apart.)"""
    cpu_kernels.use_packed_way(portable)
    values, sz = case(128, 1536, 32, 5, spread=3.0)
    x = (torch.randn(4, 1536, generator=torch.Generator().manual_seed(5)) * 8).to(torch.bfloat16)
    bound = cpu_kernels.int4_mm(pack(values, 64), 32, sz, 64)
    if bound is None:
        pytest.skip(f"the packed products do not run here: {cpu_kernels.packed_mm_why_not()}")
    folder = cpu_kernels.folder()
    chosen = pm._functions_for(folder, portable)  # the products of the way handed over
    q8s = chosen.int4_q8 is not None  # the AVX2 class's int4 and int8 products take int8 activations
    assert bound.fn is (chosen.int4_q8[64] if q8s else chosen.int4[64])
    assert cpu_kernels.int8_mm(*INT8).fn is (chosen.int8_q8 if q8s else chosen.int8)
    if not portable and pm.BF16_WAY in pm.ways(folder):
        assert cpu_kernels.packed_mm_way() == pm.BF16_WAY
        assert bound.fn is not pm._functions_for(folder, True).int4[64]
    else:  # handed over, or the one way this CPU builds
        assert chosen.name == pm.PORTABLE_WAY and pm.PORTABLE_WAY in cpu_kernels.packed_mm_way()
        want = (q8.int4_mm_q8_reference(x, values, 32, sz) if q8s
                else pm.int4_mm_portable_reference(x, values, 32, sz))
        assert torch.equal(bits(bound(x)), bits(want))


@pytest.mark.parametrize("pin", ["bf16", "portable"])
def test_loading_an_int_format_hands_the_machines_way_to_its_layers(unpinned, handed_back, monkeypatch, tiny_dirs,
                                                                       pin):
    from viasd_core.loading.models import load_model
    from viasd_core.runtime.packed_linear import PackedLinear

    monkeypatch.setenv(packed_way.ENV, pin)
    cpu_kernels.use_packed_way(pin != "portable")  # the other way: the loader must hand its own over
    loaded = load_model(str(tiny_dirs["target"]), device="cpu", quant="int8", with_tokenizer=False)
    two = len(pm.ways(cpu_kernels.folder())) == 2
    assert cpu_kernels._portable is (pin == "portable" or not two)  # one way here: the pin changes nothing
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear) and m._short is not None]
    if not layers:
        pytest.skip(f"the packed products do not run here: {cpu_kernels.packed_mm_why_not()}")
    chosen = pm._functions_for(cpu_kernels.folder(), cpu_kernels._portable)
    assert all(m._short.fn in (chosen.int8, chosen.int8_q8) for m in layers)
    cpu_kernels.use_packed_way(False)
    load_model(str(tiny_dirs["target"]), device="cpu", with_tokenizer=False)  # float32: no products to bind
    assert cpu_kernels._portable is False  # nothing handed over
