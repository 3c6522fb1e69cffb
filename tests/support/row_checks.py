"""Checks shared by the kernels' tests (a helper module, not a test file): a short-pass product's
rows against the same rows computed alone."""

from __future__ import annotations

import torch

MAX_ROWS = 16


def rows_alone_equal(bound, x: torch.Tensor, widths=range(1, MAX_ROWS + 1)) -> torch.Tensor:
    """Every row of x through `bound` is bit for bit the row computed alone on one thread, in passes
    of each width in `widths` (from both ends of x) and on 1 and 2 threads. Returns the rows computed
    alone."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([bound(x[i : i + 1].contiguous()) for i in range(x.shape[0])])
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in widths:
                assert torch.equal(bound(x[:m].contiguous()), alone[:m]), (m, t)
                assert torch.equal(bound(x[-m:].contiguous()), alone[-m:]), (m, t)
    finally:
        torch.set_num_threads(threads)
    return alone
