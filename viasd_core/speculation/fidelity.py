"""Fidelity: the fraction of emitted tokens equal to the target's greedy choice given the same
prefix, from ONE teacher-forced target pass over the finished sequence (docs/algorithm.md section 0)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def target_argmax_along(hf_model, prompt_ids: list[int], new_ids: list[int]) -> list[int]:
    """The target's greedy choice at every generated position (teacher-forced)."""
    if not new_ids:
        return []
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prompt_ids + new_ids[:-1]], device=device)
    logits = hf_model(ids, logits_to_keep=len(new_ids)).logits[0]  # [len(new), V]
    return logits.argmax(-1).tolist()


def fidelity(hf_model, prompt_ids: list[int], new_ids: list[int]) -> float:
    if not new_ids:
        return 1.0
    choice = target_argmax_along(hf_model, prompt_ids, new_ids)
    return sum(int(a == b) for a, b in zip(choice, new_ids)) / len(new_ids)
