"""FastModel (static KV cache forward) against the transformers forward, for every family."""

import pytest
import torch

from conftest import FAMILIES, tiny_model
from viasd_core.runtime.model import FastModel


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_forward_matches_transformers(family):
    model = tiny_model(family, seed=1)
    fast = FastModel(model, max_len=64)
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    # Prefill 12 positions, then one token at a time, then a block of 4 (the verification shape).
    out = [fast.forward(ids[:12], 0, 12)]
    for i in range(12, 16):
        out.append(fast.forward(ids[i : i + 1], i, 1))
    out.append(fast.forward(ids[16:20], 16, 4))
    got = torch.cat(out)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert fast.seen == 20


def test_rollback_is_a_length_reset_and_recomputes_identically():
    model = tiny_model("llama", seed=2)
    fast = FastModel(model, max_len=64)
    ids = torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(1))
    fast.forward(ids[:10], 0, 1)
    other = torch.randint(3, 256, (4,), generator=torch.Generator().manual_seed(2))
    fast.forward(other, 10, 4)  # a rejected block
    fast.rollback(10)
    assert fast.seen == 10
    got = fast.forward(ids[10:16], 10, 6)
    with torch.no_grad():
        ref = model(ids[None]).logits[0, 10:16]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_sliding_window_mask_matches_transformers():
    model = tiny_model("mistral", seed=3, sliding_window=6)
    fast = FastModel(model, max_len=64)
    ids = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    got = torch.cat([fast.forward(ids[:9], 0, 9)] + [fast.forward(ids[i : i + 1], i, 1) for i in range(9, 14)])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_unsupported_family_is_a_clear_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    from viasd_core.errors import ViasdError

    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ViasdError, match="not supported"):
        FastModel(AutoModelForCausalLM.from_config(cfg))


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_long_prefill_layer_by_layer_equals_the_prompt_fed_chunk_by_chunk(family, fmt, monkeypatch):
    """A pass longer than PREFILL_CHUNK runs layer by layer over its chunks; it must compute exactly
    what feeding the chunks as passes of their own computes (logits, keys, values and captured
    features, bit for bit; a sliding window over chunk borders included), and an int8/int4 layer is
    widened once for the whole prompt, not once a chunk."""
    from viasd_core.runtime import model_pass as model_module
    from viasd_core.runtime import weight_formats as wf
    from viasd_core.runtime.weight_format import WeightFormat

    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 32)
    extra = {"sliding_window": 40} if family == "mistral" else {}
    model = tiny_model(family, seed=4, **extra)
    if fmt != "none":
        model = wf.packed_copy(model, WeightFormat.parse(fmt))
    ids = torch.randint(3, 256, (80,), generator=torch.Generator().manual_seed(6))  # chunks of 32, 32, 16

    fasts = []

    def run(feed):
        fast = FastModel(model, max_len=96)
        fasts.append(fast)
        fast.capture_features([1, 3])
        out = feed(fast)
        keys = torch.stack([c.k[:, :, :80] for c in fast.cache.layers])
        values = torch.stack([c.v[:, :, :80] for c in fast.cache.layers])
        return out, keys, values, fast.cache.features[:80].clone()

    widened, dense = [], []
    real_widened = wf.PackedLinear.widened

    def counted(self, dtype):
        w = real_widened(self, dtype)
        widened.append(self)
        dense.append(w is not None)
        return w

    monkeypatch.setattr(wf.PackedLinear, "widened", counted)
    whole = run(lambda fast: fast.forward(ids, 0, 3))
    if fmt != "none":
        called = [m for ci in range(len(fasts[0].layers)) for p in fasts[0]._products(ci) for m in p.modules()
                  if isinstance(m, wf.PackedLinear)  # the products the pass calls (fused where they fuse) but
                  and not (m._short is not None and m._short.chunks)]  # those a prefill runs 16 rows a call
        assert sorted(map(id, widened)) == sorted(map(id, called))  # each once (the head: 3 rows, the kernel)
        # (int4: the layers whose CPU layout reads back; the others keep the kernel; none where every
        # int4 product runs a prefill in chunks of 16 rows: the AVX2 class's int8-activation products)
        assert any(dense) == bool(called)
    chunked = run(lambda fast: [fast.forward(ids[:32], 0, 1), fast.forward(ids[32:64], 32, 1)][-1] is not None
                  and fast.forward(ids[64:], 64, 3))
    for got, want in zip(whole, chunked):
        assert torch.equal(got, want)
