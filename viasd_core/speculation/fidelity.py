"""Fidelity: the fraction of emitted tokens equal to the target's greedy choice given the same
prefix (docs/algorithm.md), the target teacher-forced over the finished sequence as generation runs
it (runtime/teacher_forced.py: the prompt as a prefill, the generated tokens in passes of up to 16
positions). In a row-invariant model those are `ar`'s own choices, so `ar`, `sd` and `exact` score
exactly 1 and `viasd` loses only what its tiers accepted wrongly. A single pass through transformers'
forward would score an int format's `ar` below 1 (its prefill products round differently: 0.94-0.98
on some prompts of the int4 SmolLM2), a measurement of the reference, not of the output."""

from __future__ import annotations

import torch

from viasd_core.runtime import teacher_forced
from viasd_core.runtime.model import FastModel


def target_argmax_along(hf_model, prompt_ids: list[int], new_ids: list[int]) -> list[int]:
    """The target's greedy choice at every generated position (teacher-forced), through a FastModel
    of its own over the target's weights (a cache sized to the sequence: the session's caches, a
    chat's or a server slot's, are left as they are)."""
    if not new_ids:
        return []
    fast = FastModel(hf_model, max_len=len(prompt_ids) + len(new_ids) + 1, name="fidelity")
    return teacher_forced.choices(fast, prompt_ids, new_ids)


def fidelity(hf_model, prompt_ids: list[int], new_ids: list[int]) -> float:
    if not new_ids:
        return 1.0
    choice = target_argmax_along(hf_model, prompt_ids, new_ids)
    return sum(int(a == b) for a, b in zip(choice, new_ids)) / len(new_ids)
