"""The pass of a FastModel: tokens written at cache slots through every run layer, logits of the
rows asked for. Attention, its masks and grouped-query packing are attention.py's; the calls and C
kernels a layer makes are bound before (kernel_binding.py); a long pass (prefill) runs in chunks."""

from __future__ import annotations

from pathlib import Path

import torch

from viasd_core.runtime import attention, cpu_kernels
from viasd_core.runtime.families import softcap
from viasd_core.runtime.kernel_binding import LayerKernels, PassCalls
from viasd_core.runtime.layer_calls import LayerCalls
from viasd_core.runtime.pass_widths import PASS_WIDTHS
from viasd_core.runtime.rope import apply_rope
from viasd_core.runtime.packed_linear import widen_once

PREFILL_CHUNK = 256  # longer passes run in chunks of this many positions (bounded memory)


class DecoderPass:
    """Mixed into FastModel (model.py): uses its layers, cache, bound calls and feature slots."""

    def _run(self, input_ids: torch.Tensor, input_pos: torch.Tensor, rows: torch.Tensor, attn_len: int,
             masked: bool = True, by_row: bool = False, rope_pos: torch.Tensor | None = None,
             key_mask: torch.Tensor | None = None, plan: list[LayerKernels] | None = None,
             calls: PassCalls | None = None) -> torch.Tensor:
        """The pass: tokens `input_ids` [T] written at cache slots `input_pos` [T] (device); logits of `rows` [R].

        Attends over cache[:attn_len]; `masked=False` (a 1-token pass that may see every cached
        position) skips the mask. `by_row` (eager): each position attends in its own call over
        exactly the keys it sees (see `row_attention`). A token tree's pass (tree.py) gives its RoPE
        positions `rope_pos` [T] (default: the slots) and which slots each row sees, `key_mask`
        [T, attn_len] (default: causal by slot). Returns [R, vocab] float32. No host synchronization.

        A pass of more than PREFILL_CHUNK positions (an eager prefill: consecutive slots ending at
        attn_len) runs layer by layer, each layer over chunks of PREFILL_CHUNK positions in order:
        the chunks' intermediates bound the memory, and an int8/int4 layer is widened once for all
        of its chunks (weight_formats.widen_once) instead of once a chunk. Each chunk attends and
        multiplies exactly as a pass of its own positions would (`_chunks`).

        `plan`: the C kernels each layer calls (default: the ones bound to the cache, `bind_kernels`),
        and `calls` the calls around them (default: the eager passes' `_calls`, `_final_norm` and
        `_head`); nothing in the pass decides a kernel, and no call asks whether it is traced.
        """
        T = input_ids.shape[0]
        cache = self.cache
        plan = cache.kernels if plan is None else plan
        if calls is None:
            layer_calls_, final_norm, head = self._calls, self._final_norm, self._head
        else:
            layer_calls_, final_norm, head = calls.layers, calls.final_norm, calls.head
        x = self.embed(input_ids[None])  # [1, T, H]
        rope_pos = input_pos if rope_pos is None else rope_pos
        ropes = [(getattr(cache, "cos" + t).index_select(0, rope_pos),  # each table's rows [T, rotary dim]
                  getattr(cache, "sin_signed" + t).index_select(0, rope_pos))
                 for t in [""] + [f"_{i}" for i in range(1, cache.tables)]]
        chunks = self._chunks(T, attn_len, masked, by_row) if key_mask is None else [(0, T, attn_len, masked, by_row)]
        # per chunk: window -> its mask as every layer's attention takes it (attention.packed_mask: made
        # once a pass, not once a layer); by_row slices its keys instead
        rep, masks = self.shape.n_heads // self.shape.n_kv_heads, []
        for lo, hi, end, chunk_masked, chunk_by_row in chunks:
            if key_mask is not None and not chunk_by_row:
                packed = attention.packed_mask(key_mask, rep, x.dtype)
                masks.append({window: packed for window in set(self.windows)})  # trees: no sliding window
            elif chunk_masked and not chunk_by_row:
                key_pos = cache.key_pos[:end]
                masks.append({w: attention.packed_mask(attention.causal_mask(input_pos[lo:hi], key_pos, w), rep, x.dtype)
                              for w in set(self.windows)})
            else:
                masks.append({})
        captured: list = [None] * len(self.feature_layers)
        kernels = cpu_kernels.folder() if self.device.type == "cpu" else None  # once a pass, not once a layer
        for ci, layer in enumerate(self.layers):
            for slot in self._capture[ci]:
                captured[slot] = x[0]
            cos, sin = ropes[self._rope_ix[ci]]
            if len(chunks) == 1:
                x = self._layer(ci, plan[ci], layer_calls_[ci], x, input_pos, cos, sin, attn_len, masks[0], by_row,
                                key_mask, kernels)
                continue
            with widen_once(self._products(ci), self.dtype):
                x = torch.cat([self._layer(ci, plan[ci], layer_calls_[ci], x[:, lo:hi], input_pos[lo:hi], cos[lo:hi], sin[lo:hi], end, mask,
                                           chunk_by_row, None, kernels)
                               for (lo, hi, end, _, chunk_by_row), mask in zip(chunks, masks)], dim=1)
        for slot in self._capture[len(self.layers)]:
            captured[slot] = x[0]
        if captured:
            cache.features[input_pos] = torch.cat(captured, dim=-1)  # [T, n * H]
        h = final_norm(x[0].index_select(0, rows))
        logits = head(h)
        if self.final_softcap is not None:
            logits = softcap(logits, self.final_softcap)
        logits = logits.float()
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit:] = float("-inf")
        return logits

    def _layer(self, ci: int, bound: LayerKernels, c: LayerCalls, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, end: int, masks: dict, by_row: bool, key_mask: torch.Tensor | None,
               kernels: Path | None = None) -> torch.Tensor:
        """Run-layer `ci` over the states x [1, T, H] of slots `pos` [T], attending over cache[:end],
        calling the C kernels `bound` to it and the calls `c` (`kernels`: the C kernels' folder, looked
        up once a pass)."""
        s = self.shape
        T = x.shape[1]
        if by_row and key_mask is None and bound.front is not None:
            # the calls up to the MLP's activation in one C call, bit for bit the calls below
            x, gate_up = bound.front(x, cos, sin, pos, end)
            gate, up = gate_up.split_with_sizes(c.gate_up_split, -1)
            return c.down(c.act(gate).mul_(up), x)  # x + down_proj(...); the product in act's output
        h = c.input_norm(x)
        layer_cache = self.cache.layers[ci]
        # On CPU, eager: RoPE and the cache writes in one call, bit for bit the operators below
        # (viasd_kernels.cpu_rope_write; fused q/k/v read in place); the operators where it is not
        # bound (Qwen3's per-head norms come first) or does not take these tensors
        rotated, writer = None, bound.writer
        if c.qkv is not None:
            qkv = c.qkv(h)
            rotated = None if writer is None else writer.fused(qkv, c.qkv_split, cos, sin, pos)
            if rotated is None:
                q, k, v = qkv.split_with_sizes(c.qkv_split, -1)
        else:
            q, k, v = c.q(h), c.k(h), c.v(h)
            rotated = None if writer is None else writer(q, k, v, cos, sin, pos)
        if rotated is not None:
            q, (k_cache, v_cache) = rotated, writer.caches
        else:
            q = q.view(1, T, s.n_heads, s.head_dim)
            k = k.view(1, T, s.n_kv_heads, s.head_dim)
            v = v.view(1, T, s.n_kv_heads, s.head_dim)
            if c.q_norm is not None:  # Qwen3
                q = c.q_norm(q)
                k = c.k_norm(k)
            q = apply_rope(q.transpose(1, 2), cos, sin)  # [1, Hq, T, D]
            k = apply_rope(k.transpose(1, 2), cos, sin)  # [1, Hkv, T, D]
            k_cache, v_cache = layer_cache.update(pos, k, v.transpose(1, 2))
        if by_row:
            o = c.attend_rows(q, k_cache, v_cache, end, self.windows[ci], c.scaling, key_mask, kernels)
        else:
            o = c.attend(q, k_cache[:, :, :end], v_cache[:, :, :end], masks.get(self.windows[ci]), c.scaling)  # [1, T, Hq * D]
        x = c.o(o, x)  # x + o_proj(o)
        h = c.post_norm(x)
        if c.gate_up is not None:
            gate, up = c.gate_up(h).split_with_sizes(c.gate_up_split, -1)
            return c.down(c.act(gate).mul_(up), x)  # x + down_proj(...); the product in act's output
        return x + c.mlp(h)
    def _products(self, ci: int) -> list[torch.nn.Module]:
        """The linear layers run-layer `ci`'s pass calls (its fused projections where it has them)."""
        layer = self.layers[ci]
        attn, f = layer.self_attn, self._fused[ci]
        if f is not None and f.qkv is not None:
            qkv = [f.qkv]
        else:  # the layer's own (Phi-3: one qkv_proj)
            qkv = [getattr(attn, name) for name in ("qkv_proj", "q_proj", "k_proj", "v_proj") if hasattr(attn, name)]
        if f is not None and f.gate_up is not None:
            return qkv + [attn.o_proj, f.gate_up, layer.mlp.down_proj]
        return qkv + [attn.o_proj, layer.mlp]

    def _masked(self, T: int, end: int) -> bool:
        """Whether a pass of T positions ending at slot `end` needs a mask: more than one position,
        or a sliding window that hides some of the cached keys."""
        return T > 1 or any(w is not None and end > w for w in self.windows)

    def _chunks(self, T: int, attn_len: int, masked: bool, by_row: bool) -> list[tuple[int, int, int, bool, bool]]:
        """(lo, hi, end, masked, by_row) for each chunk of a pass of T consecutive slots ending at
        attn_len: the whole pass when T <= PREFILL_CHUNK; otherwise chunks of PREFILL_CHUNK, each
        as a pass of its own positions would be (its mask rule, and attention by row where the
        model attends by row and the chunk is a short pass)."""
        if T <= PREFILL_CHUNK:
            return [(0, T, attn_len, masked, by_row)]
        out = []
        for lo in range(0, T, PREFILL_CHUNK):
            hi = min(T, lo + PREFILL_CHUNK)
            end = attn_len - (T - hi)
            out.append((lo, hi, end, self._masked(hi - lo, end), self.row_attention and hi - lo <= PASS_WIDTHS[-1]))
        return out
