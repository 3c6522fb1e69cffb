"""Token trees: a draft proposes several continuations at once; the target checks them all in one pass.

A tree hangs below the root, the last committed token (the target's pending input at position
n - 1). Node j holds a proposed token at depth `depths[j]` (1 = a candidate for token n), below
node `parents[j]` (-1: the root). Nodes are ordered so that a parent precedes its children.

    verify   one target pass over [root, node 0, ..., node N-1]: node j sits at KV-cache slot n + j
             and RoPE position n - 1 + depths[j], and attends to the committed context, its
             ancestors and itself (`token_tree.slot_mask`). Row 0's logits are the root's, row 1 + j node j's.
    accept   the target makes one choice per row (its argmax, or one sample from its own
             distribution at that row); the walk follows the child whose token equals the choice
             and ends at the first row whose choice is no child: that choice is the bonus token
             (`accept_path`). Greedy, this is `ar`'s output exactly. Sampling, every emitted token
             is a sample of the target's distribution given the tokens before it, so the output's
             distribution is `ar`'s whatever the tree holds (the candidates are the draft's top
             choices, chosen without looking at the target's samples).
    commit   the accepted path's keys and values move from their slots to positions n, n + 1, ...
             (`FastModel.keep_path`); everything else in the tree is forgotten by the rollback.

`grow_tree` is EAGLE-2's dynamic tree: expand the `topk` best continuations of the `topk` most
probable nodes of each depth, then keep the `size` nodes of highest cumulative draft probability.
Everything here runs on the device with static shapes (no host read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from viasd_core.runtime.token_tree import TokenTree, ancestor_matrix


@dataclass(frozen=True)
class TreeShape:
    """How a tree is grown: `topk` children per expanded node and expanded nodes per depth, `depth`
    levels, `size` nodes kept (size + 1 <= the widest verify pass)."""

    topk: int
    depth: int
    size: int

    def __post_init__(self):
        if self.topk < 1 or self.depth < 1 or not 1 <= self.size <= self.candidates:
            raise ValueError(f"invalid tree shape {self}")

    @property
    def candidates(self) -> int:
        """Nodes grown before the final selection: topk at depth 1, topk * topk at each later depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def is_chain(self) -> bool:
        return self.topk == 1


def accept_path(tree: TokenTree, choices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The longest path the target agrees with (siblings hold distinct tokens, as top-k children do,
    so the walk has one way down).

    choices: [1 + N] int64, the target's choice at the root's row and at each node's row.
    Returns (n_accepted [] int64, path [max_depth] int64 node indices (the first n_accepted are the
    path, deepest last), emitted [max_depth + 1] int64 (the path's tokens, then the target's choice
    after it; only the first n_accepted + 1 are meaningful)). No host read.
    """
    N, D = tree.size, tree.max_depth
    device = choices.device
    matches = tree.tokens == choices[tree.parents + 1]  # [N]: node j is the target's choice at its parent
    good = ~(tree.ancestors & ~matches[None, :]).any(-1)  # [N]: every node on its path matches
    idx = torch.arange(N, device=device)
    rank = torch.where(good, tree.depths * (N + 1) + (N - idx), torch.full_like(idx, -1))
    best = rank.argmax()  # the deepest good node (the first of them)
    any_good = rank[best] >= 0
    n_accepted = torch.where(any_good, tree.depths[best], torch.zeros_like(best))
    on_path = tree.ancestors[best] & any_good  # [N]
    levels = torch.arange(1, D + 1, device=device)
    at_level = on_path[None, :] & (tree.depths[None, :] == levels[:, None])  # [D, N]
    path = at_level.int().argmax(-1)  # [D]
    bonus = choices[torch.where(any_good, best + 1, torch.zeros_like(best))]
    emitted = torch.cat([tree.tokens[path], tree.tokens.new_zeros(1)])
    positions = torch.arange(D + 1, device=device)
    emitted = torch.where(positions == n_accepted, bonus, emitted)
    return n_accepted, path, emitted


@dataclass
class Candidates:
    """The nodes grown so far, in growth order (a parent before its children), on the device."""

    tokens: list[torch.Tensor]
    parents: list[torch.Tensor]  # index into the concatenated candidates, -1 = root
    scores: list[torch.Tensor]  # cumulative log-probabilities
    depths: list[torch.Tensor]


def select_tree(cands: Candidates, size: int, max_depth: int) -> TokenTree:
    """Keep the `size` candidates of highest cumulative score (EAGLE-2's re-ranking). A child never
    scores above its parent and a stable sort ranks the earlier (the parent) first among equals,
    so the kept set holds every kept node's ancestors."""
    tokens, parents = torch.cat(cands.tokens), torch.cat(cands.parents)
    scores, depths = torch.cat(cands.scores), torch.cat(cands.depths)
    order = torch.sort(scores, descending=True, stable=True).indices[:size]
    keep = torch.sort(order).values  # growth order: parents first
    new_index = torch.full_like(parents, -1)
    new_index[keep] = torch.arange(size, device=keep.device)
    old_parent = parents[keep]
    kept_parents = torch.where(old_parent >= 0, new_index[old_parent.clamp_min(0)], old_parent)
    return TokenTree(tokens[keep], kept_parents, depths[keep], ancestor_matrix(kept_parents, max_depth), max_depth)
