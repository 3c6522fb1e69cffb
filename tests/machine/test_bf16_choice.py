"""Whether bfloat16 products pay, measured once a machine (viasd_core/machine/bf16.py), and the
two choices made from it: training's autocast (training/shared.resolve_bf16) and the int formats'
prefill product (runtime/packed_cpu.dense_dtype, tested in test_weight_formats.py), which each packed
layer takes at load."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from viasd_core.machine import bf16 as bf16_choice
from viasd_core.training import eagle_data, eagle_init, eagle_train
from viasd_core.training.shared import resolve_bf16


def timings(bf16_s: float, fp32_s: float):
    return lambda dtype, device: bf16_s if dtype == torch.bfloat16 else fp32_s


def test_bf16_pays_only_where_it_measures_clearly_faster():
    cpu = torch.device("cpu")
    assert bf16_choice.measure(cpu, timings(0.01, 0.05))["pays"]  # bfloat16 instructions
    slow = bf16_choice.measure(cpu, timings(0.772, 0.009))  # AVX2 only: measured on an AMD EPYC
    assert slow == {"pays": False, "bf16_ms": 772.0, "fp32_ms": 9.0}
    assert not bf16_choice.measure(cpu, timings(0.085, 0.1))["pays"]  # within 20 %: not worth the rounding
    assert bf16_choice.verdict("meta") == {"pays": False}


def test_a_gpu_is_asked_not_timed(monkeypatch):
    """The CUDA branch, on a CPU machine: the answer is the GPU's bfloat16 support, nothing timed or cached."""
    monkeypatch.setattr(bf16_choice, "measure", lambda *a: pytest.fail("a GPU's verdict is not measured"))
    for supported in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, s=supported: s)
        assert bf16_choice.verdict("cuda") == {"pays": supported}


def test_the_verdict_is_measured_once_then_read_from_the_machine_cache(viasd_home, monkeypatch):
    calls = []
    real = bf16_choice.measure
    monkeypatch.setattr(bf16_choice, "measure", lambda device: calls.append(device) or real(device, timings(0.01, 0.05)))
    first = bf16_choice.verdict("cpu")
    assert first["pays"] and first["bf16_ms"] == 10.0 and len(calls) == 1
    assert list((viasd_home / "cache" / "machine").glob("bf16-products-*.json"))
    assert bf16_choice.verdict("cpu") == first and len(calls) == 1  # read back, not measured
    assert bf16_choice.bf16_products_pay("cpu") and len(calls) == 1
    monkeypatch.setattr(bf16_choice, "measure", lambda device: calls.append(device) or real(device, timings(0.5, 0.05)))
    assert not bf16_choice.verdict("cpu", refresh=True)["pays"] and len(calls) == 2
    assert not bf16_choice.bf16_products_pay("cpu")  # the per-process answer follows a refresh
    for path in (viasd_home / "cache" / "machine").glob("bf16-products-*.json"):
        path.write_text("not json")
    assert bf16_choice.verdict("cpu")["pays"] is False and len(calls) == 3  # unreadable: measured again


@pytest.mark.parametrize("pays", [True, False])
def test_the_loader_binds_the_verdict_into_every_packed_layer_and_its_twins(tmp_path, monkeypatch, pays):
    """The runtime asks no machine decision: load_model records the verdict on the model, and every
    layer packed from it (the target's own, a slim view's twin) holds it from then on."""
    from viasd_core.loading import models
    from viasd_core.runtime.packed_linear import PackedLinear
    from viasd_core.runtime.weight_format import WeightFormat
    from viasd_core.runtime.weight_formats import packed_copy

    folder = tmp_path / "m"
    tiny_model("llama", n_layers=2, seed=1).save_pretrained(folder)
    monkeypatch.setattr(models, "bf16_products_pay", lambda device: pays)
    for quant in ("int8", "int4"):
        packed = [m for m in models.load_model(str(folder), device="cpu", quant=quant, with_tokenizer=False).model.modules()
                  if isinstance(m, PackedLinear)]
        assert packed and all(m.bf16_pays is pays for m in packed)
    target = models.load_model(str(folder), device="cpu", quant="none", with_tokenizer=False).model
    twin = [m for m in packed_copy(target, WeightFormat.parse("int4")).modules() if isinstance(m, PackedLinear)]
    assert twin and all(m.bf16_pays is pays for m in twin)


def test_the_real_products_are_timed():
    for dtype in (torch.float32, torch.bfloat16):
        assert 0 < bf16_choice.product_seconds(dtype, torch.device("cpu"), rows=16, rounds=1) < 60


def test_training_takes_an_explicit_choice_else_the_measured_one(monkeypatch):
    lines = []
    assert resolve_bf16(True, "cpu", lines.append) is True and resolve_bf16(False, "cpu", lines.append) is False
    assert lines == []  # nothing measured, nothing said
    for pays in (True, False):
        monkeypatch.setattr("viasd_core.training.shared.bf16_products_pay", lambda device, pays=pays: pays)
        assert resolve_bf16(None, "cpu", lines.append) is pays
        assert ("bfloat16 autocast" in lines[-1]) == pays and "(measured)" in lines[-1]


def test_head_training_records_the_precision_it_used():
    target = tiny_model("llama", n_layers=4, seed=2)
    seqs = [(torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(i)).tolist(), 5, "") for i in range(4)]
    recs = eagle_data.teacher_pass(target, seqs, (1, 2, 3))
    for choice in (False, True):
        head = eagle_init.init_head(target, (1, 2, 3), torch.arange(256))
        out = eagle_train.train_head(head, recs, eagle_train.HeadTrainConfig(steps=2, batch_size=2, warmup=1, bf16=choice,
                                                                              checkpoint_every=10 ** 9, eval_every=10 ** 9))
        assert out["bf16_autocast"] is choice
