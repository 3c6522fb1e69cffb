"""The one attention routine (viasd_core/runtime/attention.py) against a plain softmax(QK^T)V, its
masks against their definitions, and its three users (FastModel, FeatureHead, the head's training)
calling it; plus the one meaning of rollback."""

from __future__ import annotations

import os

import pytest
import torch
from viasd_kernels import cpu_row_attention

from conftest import tiny_model
from viasd_core import paths
from viasd_core.runtime import attention
from viasd_core.runtime.model import FastModel
from viasd_core.training import eagle_init, eagle_ttt


def reference(q, k, v, mask, scale=None):
    """softmax(QK^T * scale)V with K/V repeated per query head (transformers' repeat_kv), float64:
    [B, T, Hq * D]. mask [T, L] bool (True: attend) or None."""
    B, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    k, v = k.double().repeat_interleave(rep, dim=1), v.double().repeat_interleave(rep, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)  # [B, Hq, T, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, Hq * D)


def qkv(B, Hq, Hkv, T, L, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, T, D, generator=g, dtype=dtype), torch.randn(B, Hkv, L, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, L, D, generator=g, dtype=dtype))


# (B, T, L, D, Hkv): one query over one key, short and odd lengths, a cache longer than the pass
SIZES = [(1, 1, 1, 8, 1), (1, 3, 7, 24, 2), (2, 5, 5, 16, 1), (1, 13, 29, 40, 3), (2, 1, 17, 12, 2)]


@pytest.mark.parametrize("ratio", [1, 2, 4, 7])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "B{}T{}L{}D{}kv{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attend_equals_the_plain_reference(ratio, size, dtype):
    B, T, L, D, Hkv = size
    q, k, v = qkv(B, Hkv * ratio, Hkv, T, L, D, dtype, seed=ratio * 100 + T)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    query_pos = torch.arange(L - T, L)  # the pass's positions: the last T of the keys
    key_pos = torch.arange(L)
    random = torch.rand(T, L, generator=torch.Generator().manual_seed(T)) < 0.5
    random[:, 0] = True  # no empty row
    masks = {"none": None, "causal": attention.causal_mask(query_pos, key_pos),
             "window3": attention.causal_mask(query_pos, key_pos, 3), "random": random}
    for name, mask in masks.items():
        for scale in (None, 0.37):
            got = attention.attend(q, k, v, mask, scale)
            assert got.shape == (B, T, Hkv * ratio * D) and got.dtype == dtype
            torch.testing.assert_close(got.double(), reference(q, k, v, mask, scale), **tol, msg=f"{name} {scale}")


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_mask_packed_once_gives_the_bool_masks_outputs_bit_for_bit(ratio, dtype, softcap):
    # a pass packs each chunk's mask once for all of its layers (attention.packed_mask): every output
    # must be the one attend computes from the bool mask at each call (the plain reference)
    T, L, D, Hkv = 37, 300, 16, 2
    q, k, v = qkv(1, Hkv * ratio, Hkv, T, L, D, dtype, seed=11 * ratio)
    query_pos, key_pos = torch.arange(L - T, L), torch.arange(L)
    random = torch.rand(T, L, generator=torch.Generator().manual_seed(3)) < 0.5
    random[:, 0] = True
    for mask in (attention.causal_mask(query_pos, key_pos), attention.causal_mask(query_pos, key_pos, 5), random):
        packed = attention.packed_mask(mask, ratio, dtype)
        assert packed.shape == (ratio * T, L) and packed.dtype == dtype
        assert set(packed.float().unique().tolist()) <= {0.0, float("-inf")}
        want = attention.attend(q, k, v, mask, 0.3, softcap)
        got = attention.attend(q, k, v, packed, 0.3, softcap)
        assert torch.equal(got, want)
        assert not torch.equal(got, attention.attend(q, k, v, None, 0.3, softcap))  # the mask is applied


def test_a_pass_over_a_static_cache_ignores_the_stale_positions_past_it():
    """Keys past the pass's positions (stale or garbage in a static cache) change nothing."""
    q, k, v = qkv(1, 8, 2, 4, 20, 16, torch.float64, seed=1)
    query_pos, key_pos = torch.arange(6, 10), torch.arange(20)
    got = attention.attend(q, k, v, attention.causal_mask(query_pos, key_pos))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 10:], v2[:, :, 10:] = 1e3, -1e3
    assert torch.equal(attention.attend(q, k2, v2, attention.causal_mask(query_pos, key_pos)), got)
    torch.testing.assert_close(got, reference(q, k[:, :, :10], v[:, :, :10], attention.causal_mask(query_pos, key_pos[:10])))


@pytest.mark.parametrize("ratio", [1, 2, 4, 7])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 32])  # 24: the reference's loop (the kernel takes multiples of 16); 32: the kernel
def test_attend_by_row_is_the_masked_pass_and_each_row_is_its_own_one_row_pass(ratio, window, dtype, D):
    T, end = 5, 11
    q, k, v = qkv(1, 2 * ratio, 2, T, end + 4, D, dtype, seed=ratio)  # 4 positions of slack past the pass
    by_row = attention.attend_by_row(q, k, v, end, window, 0.3)
    loop = attention.attend_by_row_reference(q, k, v, end, window, 0.3)
    mask = attention.causal_mask(torch.arange(end - T, end), torch.arange(end), window)
    want = reference(q, k[:, :, :end], v[:, :, :end], mask, 0.3)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got in (by_row, loop):
        torch.testing.assert_close(got.double(), want, **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(loop, attention.attend(q, k[:, :, :end], v[:, :, :end], mask, 0.3), rtol=1e-5, atol=1e-5)
    for i in range(T):  # batch invariance: row i's numbers are those of a pass holding only row i
        stop = end - T + i + 1
        alone = attention.attend_by_row(q[:, :, i : i + 1], k, v, stop, window, 0.3)
        assert torch.equal(by_row[:, i], alone[:, 0])
        lo = 0 if window is None else max(0, stop - window)  # the reference: the plain call over exactly its keys
        plain = attention.attend(q[:, :, i : i + 1], k[:, :, lo:stop], v[:, :, lo:stop], None, 0.3)
        assert torch.equal(loop[:, i], plain[:, 0])


def test_attend_by_row_takes_the_kernel_on_a_cpu_where_it_builds(monkeypatch):
    """With D a multiple of 16 on a CPU the kernel runs (its numbers differ from the loop's in the
    last bits); with the kernel turned off (`row_kernel` False) the loop does."""
    q, k, v = qkv(1, 4, 2, 6, 40, 32, torch.bfloat16, seed=3)
    if cpu_row_attention.row_attention(q, k, v, 40, build_dir=paths.kernel_dir()) is None:
        assert not os.environ.get("CI"), f"the row-attention kernel must build in CI: {cpu_row_attention.why_not()}"
        pytest.skip(f"the row-attention kernel cannot be built here: {cpu_row_attention.why_not()}")
    calls = []
    real = cpu_row_attention.row_attention
    monkeypatch.setattr(cpu_row_attention, "row_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kernel = attention.attend_by_row(q, k, v, 40)
    assert calls == [1]
    assert torch.equal(kernel, real(q, k, v, 40, build_dir=paths.kernel_dir()))
    off = attention.attend_by_row(q, k, v, 40, row_kernel=False)
    assert torch.equal(off, attention.attend_by_row_reference(q, k, v, 40)) and calls == [1]
    # the choice is made once for a layer: on a CPU without a cap the kernel, with a cap or turned off the loop
    cpu = torch.device("cpu")
    assert attention.row_call(cpu) is attention.row_call(cpu)
    assert torch.equal(attention.row_call(cpu)(q, k, v, 40, None, None, None, None), kernel) and calls == [1, 1]
    assert torch.equal(attention.row_call(cpu, row_kernel=False)(q, k, v, 40, None, None, None, None), off)
    capped = attention.row_call(cpu, softcap=50.0)(q, k, v, 40, None, None, None, None)
    assert torch.equal(capped, attention.attend_by_row_reference(q, k, v, 40, softcap=50.0)) and calls == [1, 1]


def test_masks_follow_their_definitions():
    query_pos, key_pos = torch.tensor([3, 4, 5]), torch.arange(8)
    for window in (None, 2):
        mask = attention.causal_mask(query_pos, key_pos, window)
        want = [[p <= q and (window is None or p > q - window) for p in range(8)] for q in (3, 4, 5)]
        assert mask.tolist() == want
    n = 6
    for step in range(4):
        mask = attention.ttt_mask(n, step)
        assert mask.shape == (n, (step + 1) * n)
        for q in range(n):
            want = [p <= q - step for p in range(n)]  # step 0's keys up to the anchor
            for k in range(1, step + 1):  # then step k's key at q - step + k
                want += [p == q - step + k for p in range(n)]
            assert mask[q].tolist() == want, (step, q)
        assert bool(mask.any(-1).all())  # no row without a key (an empty row would give NaN)


def test_packing_refuses_heads_that_do_not_group():
    q, k, v = qkv(1, 6, 4, 2, 3, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="not a multiple"):
        attention.attend(q, k, v)


# ---------------------------------------------------------------------- the three users
class Calls:
    """Counts calls of the shared routine (attention._sdpa_packed: `attend` and every pass reach it) and of SDPA (which only it may call)."""

    def __init__(self, monkeypatch):
        self.attend = self.sdpa = 0
        attend, sdpa = attention._sdpa_packed, torch.nn.functional.scaled_dot_product_attention

        def counted_attend(*args, **kwargs):
            self.attend += 1
            return attend(*args, **kwargs)

        def counted_sdpa(*args, **kwargs):
            self.sdpa += 1
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(attention, "_sdpa_packed", counted_attend)  # the routine, as a pass binds it
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)

    def take(self) -> tuple[int, int]:
        counts = (self.attend, self.sdpa)
        self.attend = self.sdpa = 0
        return counts


def test_every_user_attends_through_the_shared_routine(monkeypatch):
    calls = Calls(monkeypatch)  # before the model binds its layers' calls
    target = tiny_model("llama", n_layers=3, seed=7)
    fast = FastModel(target, max_len=32)
    fast.row_attention = False  # one call a layer (as a slim view attends); by row below
    head = eagle_init.init_head(target, (0, 1, 2), torch.arange(0, 256, 2), seed=0)
    head.allocate(32)
    ids = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(7))
    calls.take()

    fast.forward(ids[:6], 0, 1)  # a prefill: one call a layer
    assert calls.take() == (3, 3)
    fast.forward(ids[6:7], 6, 1)
    assert calls.take() == (3, 3)
    fast.row_attention = True  # by row on a CPU: one call of the row kernel a layer
    built = attention.by_row_way().startswith("viasd_kernels'")
    kernel_calls = []
    real = cpu_row_attention.row_attention
    monkeypatch.setattr(cpu_row_attention, "row_attention", lambda *a, **kw: kernel_calls.append(1) or real(*a, **kw))
    for bound in fast.cache.kernels:  # a float32 layer front calls the row kernel from C (test_layer_calls.py)
        if bound.front is not None:
            bound.front.fn = lambda *a, call=bound.front.fn: kernel_calls.append(1) or call(*a)
    fast.forward(ids[7:10], 7, 3)
    assert len(kernel_calls) == 3 and calls.take() == ((0, 0) if built else (9, 9))
    fast.bind_kernels(row_kernel=False)  # the reference: one call a layer and position
    fast.rollback(7)
    fast.forward(ids[7:10], 7, 3)
    assert calls.take() == (9, 9)

    feats = torch.randn(6, 3 * target.config.hidden_size)
    head.forward(ids[1:7], feats, 0)
    assert calls.take() == (1, 1)

    eagle_ttt.ttt_logits(head, ids[None, :7], feats[None], steps=3)
    assert calls.take() == (3, 3)  # one call a drafting step


# ---------------------------------------------------------------------- rollback
def test_rollback_keeps_n_positions_in_the_model_and_the_head():
    target = tiny_model("llama", n_layers=3, seed=8)
    head = eagle_init.init_head(target, (0, 1, 2), torch.arange(0, 256, 2), seed=0)
    head.allocate(32)
    ids = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(8))
    feats = torch.randn(10, 3 * target.config.hidden_size)
    fast = FastModel(target, max_len=32)
    fast.forward(ids[:10], 0, 1)
    head.forward(ids[1:11], feats, 0)
    for cache in (fast, head):
        assert cache.seen == 10
        cache.rollback(7)
        assert cache.seen == 7  # the first 7 positions kept
        cache.rollback(9)
        assert cache.seen == 7  # never grows back
        cache.rollback(0)
        assert cache.seen == 0
        with pytest.raises(ValueError, match="keeps a number of positions"):
            cache.rollback(-1)
