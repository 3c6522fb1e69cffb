"""A model's greedy choice at every position of a known continuation, computed as generation computes it.

`choices(fast, prompt, cont)` runs the prompt up to its last token as a prefill, then that token and
the continuation in passes of up to `SHORT_PASS` positions, as the engine does (its prefill stops
before the last prompt token, which the first step runs): the passes `ar` (one row) and `sd`'s
verify blocks (up to 16 rows) run. In a
row-invariant model (FastModel.row_attention: every CPU pass in float32, bfloat16, int8 and int4)
each row's numbers do not depend on its pass, so the choices are exactly those `ar` makes after the
same prefix. One pass over the whole sequence (`passes="one"`) takes a prefill's products instead
(on a CPU an int format's dense product over the widened weight), which no generated token uses: it
can disagree with `ar` where two logits nearly tie.

Fidelity (speculation/fidelity.py) and the agreement with llama.cpp (benchmarks/suites/
llama_cpp_agreement.py) score against it.
"""

from __future__ import annotations

import torch

from viasd_core.runtime.model import FastModel

SHORT_PASS = 16  # positions per pass of the continuation: a verify block's width at most


def choices(fast: FastModel, prompt: list[int], cont: list[int], passes: str = "short") -> list[int]:
    """`fast`'s greedy choice after prompt + cont[:i], for every i < len(cont) (its cache is reset first
    and holds the sequence after)."""
    if not cont:
        return []
    fast.reset()
    with torch.inference_mode():
        if passes == "one":
            ids = torch.tensor(prompt + cont, device=fast.device)
            logits = fast.forward(ids, 0, len(cont) + 1)[: len(cont)]  # positions len(prompt) - 1 ...
        elif passes == "short":
            if len(prompt) > 1:
                fast.forward(torch.tensor(prompt[:-1], device=fast.device), 0, 1)  # the engine's prefill
            rest, start, rows = prompt[-1:] + cont[:-1], len(prompt) - 1, []
            for i in range(0, len(rest), SHORT_PASS):
                chunk = rest[i : i + SHORT_PASS]
                rows.append(fast.forward(torch.tensor(chunk, device=fast.device), start + i, len(chunk)))
            logits = torch.cat(rows)
        else:
            raise ValueError(f"passes is 'short' or 'one', not {passes!r}")
    return logits.argmax(-1).tolist()
