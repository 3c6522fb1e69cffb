"""Row invariance's check, shared by its tests and the families' (a helper module, not a test
file): a tiny target in each format, and the rows of its passes of every width and of a token tree
that differ from the same positions decoded alone."""

from __future__ import annotations

import torch

from conftest import tiny_model
from viasd_core.runtime.model import FastModel
from viasd_core.runtime.token_tree import TokenTree, ancestor_matrix
from viasd_core.runtime.weight_format import WeightFormat
from viasd_core.runtime.weight_formats import apply_weight_format

PROMPT, SPAN = 20, 16  # a prefill of PROMPT positions, then SPAN positions compared
WIDTHS = (2, 3, 5, 6, 8, 11, 16)
FORMATS = ("float32", "bfloat16", "int8", "int4")


def target(family: str, fmt: str) -> FastModel:
    model = tiny_model(family, n_layers=3, seed=3)
    if fmt != "float32":
        model = model.to(torch.bfloat16)
    if fmt in ("int8", "int4"):
        apply_weight_format(model, WeightFormat.parse(fmt))
    return FastModel(model, max_len=128)


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def alone(fast: FastModel, ids: torch.Tensor) -> torch.Tensor:
    """Positions PROMPT .. PROMPT + SPAN - 1 each decoded alone (1-token passes): [SPAN, vocab]."""
    fast.reset()
    fast.forward(ids[:PROMPT], 0, 1)
    return torch.cat([fast.forward(ids[p : p + 1], p, 1) for p in range(PROMPT, PROMPT + SPAN)])


def in_passes_of(fast: FastModel, ids: torch.Tensor, width: int) -> torch.Tensor:
    """The same positions verified in passes of `width` rows (every row's logits)."""
    fast.rollback(PROMPT)
    out = []
    for lo in range(PROMPT, PROMPT + SPAN, width):
        hi = min(lo + width, PROMPT + SPAN)
        out.append(fast.forward(ids[lo:hi], lo, hi - lo))
    return torch.cat(out)


def in_a_tree(fast: FastModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token tree over the root PROMPT (after 3 cached positions): the chain of the next 4 tokens
    as its first branch, with siblings off the root and off its second node. (the tree's rows for
    the root and the chain, the same positions decoded alone)."""
    n = PROMPT + 4
    chain = ids[n : n + 4]
    toks = torch.cat([chain, torch.tensor([7, 9, 11])])
    parents = torch.tensor([-1, 0, 1, 2, -1, 1, -1])
    depths = torch.tensor([1, 2, 3, 4, 1, 3, 1])
    tree = TokenTree(toks, parents, depths, ancestor_matrix(parents, 4), 4)
    fast.rollback(n - 1)
    got = fast.verify_tree(ids, n, tree)  # root (position n - 1) and the 7 nodes
    fast.rollback(PROMPT)
    want = torch.cat([fast.forward(ids[p : p + 1], p, 1) for p in range(PROMPT, n + 4)])
    return torch.cat([got[:1], got[1:5]]), want[n - 1 - PROMPT :]


def width_dependent_rows(fast: FastModel, ids: torch.Tensor) -> dict:
    """{width or "tree": rows whose logits differ from the row decoded alone} (empty: invariant)."""
    ref = alone(fast, ids)
    bad = {}
    for w in WIDTHS:
        got = in_passes_of(fast, ids, w)
        rows = (got != ref).any(-1).nonzero().flatten().tolist()
        if rows:
            bad[w] = rows
    if fast.supports_tree:
        got, want = in_a_tree(fast, ids)
        rows = (got != want).any(-1).nonzero().flatten().tolist()
        if rows:
            bad["tree"] = rows
    return bad
