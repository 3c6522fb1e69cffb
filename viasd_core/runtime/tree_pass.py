"""A token tree's target pass over the static KV cache (tree.py), as FastModel methods.

`verify_tree` runs the root and every node in one pass: node j at cache slot n + j, RoPE position
n - 1 + depth, attending to the committed positions, its ancestors and itself (tree.slot_mask).
Compiled, it is one graph per verify width with the mask as an input; eager, the int formats on a
CPU attend row by row over exactly each row's keys (FastModel.row_attention). `keep_path` moves the
accepted path's keys, values and features into place after the step.
"""

from __future__ import annotations

import time

import torch

from viasd_core.runtime import attention
from viasd_core.runtime.pass_widths import PASS_WIDTHS, pass_width
from viasd_core.runtime.token_tree import TokenTree, ancestor_matrix, slot_mask
from viasd_core.errors import ViasdError

class TreePasses:
    """Mixed into FastModel (model.py): uses its cache, `_run`, `_compiled` and `graph_shapes`."""

    @property
    def supports_tree(self) -> bool:
        """Tree passes give every row its own keys: not combined with a sliding window here."""
        return all(w is None for w in self.windows)

    @torch.inference_mode()
    def verify_tree(self, ids: torch.Tensor, n: int, tree: TokenTree) -> torch.Tensor:
        """One pass over the root (position n - 1, after any positions not yet cached) and the tree's
        N nodes at slots n .. n + N - 1: logits [1 + N, vocab] float32 of the root and each node.

        Compiled where the pass fits a verify width (one graph per width, the slots' mask an input),
        eager otherwise, with `row_attention` where the eager pass needs it (every row then attends
        over exactly its own keys, in cache order: the numbers of a plain pass over its path).
        """
        N = tree.size
        start = min(self.seen, n - 1)
        end = n + N
        if end > self.max_len:
            raise ViasdError(f"context of {end} tokens exceeds the {self.max_len} positions allocated for "
                             f"'{self.name}': raise --max-context or shorten the prompt")
        tokens = torch.cat([ids[start:n], tree.tokens])  # [T]
        T = tokens.shape[0]
        slots = torch.arange(start, end, device=self.device)
        rope = torch.cat([slots[: n - start], n - 1 + tree.depths])
        self.passes += 1
        self.positions_run += T
        width = pass_width(T) if T <= PASS_WIDTHS[-1] else 0
        if self._compiled is not None and (width, width) in self.graph_shapes():
            pad = width - T  # padding rows sit after the tree, each seeing only its own slot
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            slots = torch.arange(start, start + width, device=self.device)
            rope = torch.cat([rope, slots[T:]])
            key_mask = self._tree_mask(tree, n, start, self.cache.key_pos[: self.max_len], slots)
            out = self._compiled(tokens, slots, torch.arange(width, device=self.device), self.max_len, True, False,
                                 rope, key_mask)[T - 1 - N : T]
        else:
            key_mask = self._tree_mask(tree, n, start, self.cache.key_pos[:end], slots)
            rows = torch.arange(T - 1 - N, T, device=self.device)
            out = self._run(tokens, slots, rows, end, True, self.row_attention, rope, key_mask)
        self.seen = end
        return out

    def warm_up_tree(self, size: int) -> float:
        """Compile the tree pass of `size` tokens (root and nodes) now; seconds taken (0.0 eager)."""
        width = pass_width(size)
        if self._compiled is None or (width, width) not in self.graph_shapes():
            return 0.0
        t0 = time.perf_counter()
        parents = torch.arange(-1, size - 2, device=self.device)  # a chain: any tree has the same graph
        depths = torch.arange(1, size, device=self.device)
        tree = TokenTree(torch.zeros(size - 1, dtype=torch.long, device=self.device), parents, depths,
                         ancestor_matrix(parents, size - 1), size - 1)
        self.reset()
        self.verify_tree(torch.zeros(1, dtype=torch.long, device=self.device), 1, tree)
        self.reset()
        self.passes = self.positions_run = 0
        return time.perf_counter() - t0

    @staticmethod
    def _tree_mask(tree: TokenTree, n: int, start: int, key_slots: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """[rows, L]: causal rows for the positions before the root, the tree's rows
        (tree.slot_mask), and each padding row (past the tree) seeing its own slot only."""
        before = attention.causal_mask(slots[: n - 1 - start], key_slots)
        pads = slots[n + tree.size - start :, None] == key_slots[None, :]
        return torch.cat([before, slot_mask(tree, n, key_slots), pads])

    def keep_path(self, n: int, path: list[int]) -> None:
        """After a tree pass at n: move the keys, values (and features) of the accepted nodes `path`
        (node indices, root to leaf) from their slots n + j to positions n, n + 1, ..."""
        if path == list(range(len(path))):
            return  # already in place (a chain, or the tree's first branch)
        src = torch.tensor([n + j for j in path], device=self.device)
        dst = torch.arange(n, n + len(path), device=self.device)
        for layer in self.cache.layers:
            layer.k[:, :, dst] = layer.k[:, :, src]
            layer.v[:, :, dst] = layer.v[:, :, src]
        if self.cache.features is not None:
            self.cache.features[dst] = self.cache.features[src]

