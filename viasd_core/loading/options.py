"""What the user asks of a model pair: the options every model command shares, as one value."""

from __future__ import annotations

from dataclasses import dataclass

from viasd_core.loading.models import EMBEDDED_TARGET


@dataclass
class ModelOptions:
    model: str = EMBEDDED_TARGET
    draft: str | None = None  # None/'auto', 'ngram', 'none', a model reference
    revision: str | None = None
    dtype: str | None = None
    device: str | None = None
    quant: str = "auto"  # auto: on a CPU, the embedded target's fastest measured format (loading.models.resolve_format), else none
    draft_quant: str = "none"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    profile: str | None = None
    max_context: int | None = None  # positions every KV cache holds (None: sized from model and memory)
    compile: str = "auto"  # auto (on for CUDA), on, off
    tree: str = "auto"  # sd's draft trees: auto (measured here: machine/tree.py), off, or a node count
    threads: str = "auto"  # CPU threads: auto (measured at start-up: threads.py) or a count


DEFAULT_CONTEXT_CAP = 4096  # the default --max-context never exceeds this (raise it explicitly)
