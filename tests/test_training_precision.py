"""Training precision chosen by measuring the machine (viasd_core/training/shared.py): bfloat16
autocast only where its products measure faster than float32 ones, an explicit choice kept."""

from __future__ import annotations

import torch

from viasd_core.training import eagle_train
from viasd_core.training.shared import _matmul_seconds, bf16_autocast_pays, resolve_bf16

from conftest import tiny_model


def timings(bf16_s: float, fp32_s: float):
    return lambda dtype, device: bf16_s if dtype == torch.bfloat16 else fp32_s


def test_bf16_is_chosen_only_where_it_measures_clearly_faster():
    assert bf16_autocast_pays("cpu", timings(0.01, 0.05))  # a CPU with bfloat16 instructions
    assert not bf16_autocast_pays("cpu", timings(1.5, 0.1))  # AVX2 only: bfloat16 emulated
    assert not bf16_autocast_pays("cpu", timings(0.09, 0.1))  # within 20 %: not worth the rounding
    assert not bf16_autocast_pays("meta")


def test_the_probe_times_real_products_and_an_explicit_choice_wins():
    for dtype in (torch.float32, torch.bfloat16):
        assert 0 < _matmul_seconds(dtype, torch.device("cpu"), rounds=1) < 60
    lines = []
    assert resolve_bf16(True, "cpu", lines.append) is True and resolve_bf16(False, "cpu", lines.append) is False
    assert lines == []  # nothing measured, nothing said
    measured = resolve_bf16(None, "cpu", lines.append)
    assert len(lines) == 1 and ("bfloat16 autocast" in lines[0]) == measured


def test_head_training_records_the_precision_it_used():
    target = tiny_model("llama", n_layers=4, seed=2)
    seqs = [(torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(i)).tolist(), 5, "") for i in range(4)]
    recs = eagle_train.teacher_pass(target, seqs, (1, 2, 3))
    for choice in (False, True):
        head = eagle_train.init_head(target, (1, 2, 3), torch.arange(256))
        out = eagle_train.train_head(head, recs, eagle_train.HeadTrainConfig(steps=2, batch_size=2, warmup=1, bf16=choice,
                                                                              checkpoint_every=10 ** 9, eval_every=10 ** 9))
        assert out["bf16_autocast"] is choice
