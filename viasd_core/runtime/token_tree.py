"""A token tree as the target's pass sees it: its nodes (tokens, parents, depths), which node sees
which (`ancestor_matrix`), and the attention masks over the cache slots (`slot_mask`,
`region_mask`). How a tree is grown, and which path the target accepts: speculation/tree.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenTree:
    tokens: torch.Tensor  # [N] int64 target token ids
    parents: torch.Tensor  # [N] int64, -1 = the root
    depths: torch.Tensor  # [N] int64, 1..max_depth
    ancestors: torch.Tensor  # [N, N] bool: ancestors[i, j] iff node j is node i or an ancestor of it
    max_depth: int  # host: the deepest a node may be (the shape's depth)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N, N] bool: node j is node i or one of its ancestors. `parents` [N] (-1: the root)."""
    N = parents.shape[0]
    step = torch.zeros(N, N + 1, dtype=torch.float32, device=parents.device)
    step[torch.arange(N, device=parents.device), parents.clamp_min(-1) % (N + 1)] = 1.0  # -1 -> column N (the root)
    step = step[:, :N]  # [N, N]: i -> its parent (no row for the root)
    reach = torch.eye(N, device=parents.device)
    up = reach
    for _ in range(max_depth - 1):
        up = up @ step
        reach = reach + up
    return reach > 0


def region_mask(context: int, sees: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """[R, L] bool over cache slots `key_slots` [L] for rows whose keys are the slots before
    `context` and, of the R tree slots context .. context + R - 1, those marked in `sees` [R, R]."""
    R = sees.shape[1]
    rel = key_slots - context  # [L] the tree slot a key is, if any
    in_tree = (rel >= 0) & (rel < R)
    return (key_slots < context)[None, :] | (sees[:, rel.clamp(0, R - 1)] & in_tree[None, :])


def slot_mask(tree: TokenTree, context: int, key_slots: torch.Tensor) -> torch.Tensor:
    """[1 + N, L] bool over cache slots `key_slots` [L]: the root (slot context - 1) sees slots
    < context; node j (slot context + j) sees those, its ancestors' slots and its own."""
    root = (key_slots < context)[None, :]
    return torch.cat([root, region_mask(context, tree.ancestors, key_slots)])
