"""The widths a short pass is padded to: one compiled graph per width, whatever the draft length."""

from __future__ import annotations

PASS_WIDTHS = (1, 2, 4, 8, 16)  # a pass of T <= 16 tokens is padded to the next width


def pass_width(n: int) -> int:
    """The padded width of a pass over n <= PASS_WIDTHS[-1] tokens."""
    for w in PASS_WIDTHS:
        if n <= w:
            return w
    raise ValueError(f"a padded pass covers at most {PASS_WIDTHS[-1]} tokens, got {n}")
