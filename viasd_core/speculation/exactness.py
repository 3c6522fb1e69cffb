"""What `sd` and `exact` promise against `ar` for a model as it runs: bit-exact, or equal up to rounding.

The speculative modes emit `ar`'s tokens when a position's logits do not depend on the pass that
computed them (a 1-token decode pass, a verify block of up to 16 rows, a token tree's pass). That is
a property of the passes, so it is decided here from the model as built, in one place that doctor,
`--verbose`, the bench and the docs' table read:

- **exact** (bit for bit, greedy; the same distribution when sampling): eager passes on a CPU of a
  model whose short passes are row-invariant (FastModel.row_attention: every row attends over exactly
  its keys and multiplies through products that compute each row alike at any row count) in float32,
  bfloat16, int8 or int4, on every instruction-set class and with or without viasd's C kernels
  (tests/machine/test_row_invariance.py);
- **up to rounding** (a token may differ where two logits nearly tie): bitsandbytes' CPU formats
  (their kernels take another path for another number of rows), compiled passes (one graph per padded
  width), a model built without row attention (a slim view), and every pass on a GPU (not measured
  here: no GPU was available).
"""

from __future__ import annotations

from typing import NamedTuple


class Promise(NamedTuple):
    exact: bool  # bit-exact: any divergence from `ar` is a bug
    why: str


def promise(model) -> Promise:
    """What `sd`/`exact` promise against `ar` for the FastModel `model` as it runs now."""
    if model.quantized:
        return Promise(False, "bitsandbytes' kernels round a row differently with the number of rows in its pass")
    if model.device.type != "cpu":
        return Promise(False, f"on {model.device.type} the passes are not row-invariant by construction (not measured)")
    if model.compiled:
        return Promise(False, "compiled passes run one graph per padded width, each rounding its own way "
                              "(--compile off is exact)")
    if not model.row_attention:
        return Promise(False, "this model's passes are not row-invariant (row attention off)")
    return Promise(True, "row-invariant passes (each row attends and multiplies as it would alone): "
                         "sd and exact emit ar's tokens bit for bit")


def note(model, mode: str) -> str | None:
    """The line a session in `mode` says on stderr where its tokens may differ from `ar`'s: a
    speculative mode promised only up to rounding (None elsewhere: bit-exact, or not an exact mode)."""
    p = promise(model)
    if mode not in ("sd", "exact") or p.exact:
        return None
    return f"note: {mode} may differ from ar here where two tokens nearly tie: {p.why}"
