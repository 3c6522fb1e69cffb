"""Attention in one place: the static KV cache, the masks, grouped-query packing and the one call.

Three users attend through `attend`: `FastModel` (target, slim verifier, draft model: a static
cache per layer), `FeatureHead` (the EAGLE-3 head's own one-layer cache) and
`eagle_ttt.ttt_logits` (the head's training-time test, no cache). They differ only in their masks,
all made here from positions:

    causal_mask(query_pos, key_pos, window)   [T, L]: key p is seen from query q iff p <= q (and
                                              p > q - window with a sliding window). Over a static
                                              cache, keys past the pass are stale or garbage: masked.
    ttt_mask(T, step)                         [T, (step + 1) * T]: the training-time test's keys
                                              (see the function).

Grouped-query packing: the `rep = Hq // Hkv` query heads that read one KV head are laid along the
query axis, q [B, Hq, T, D] -> [B, Hkv, rep * T, D] (query head h reads KV head h // rep, as in
transformers' `repeat_kv`), and the mask is repeated to match. SDPA then takes its fused path with a
mask, with no `enable_gqa` and no K/V repeat (tests/runtime/test_attention.py compares it with a plain
softmax(QK^T)V over repeated K/V).

`attend_by_row` attends every query position over exactly the keys it sees, each row's numbers a
function of that row alone: a position comes out the same whatever its pass holds
(FastModel.row_attention says when that matters). On a CPU it is one call of viasd_kernels'
row-invariant kernel (built once per machine; `row_kernel` False turns it off); elsewhere, or where
the kernel cannot be built, `attend_by_row_reference`: `attend` once per row, over exactly its keys.

FastModel's pass decides none of this per call: each layer's calls (layer_calls.py) hold the
attention `packed_call` and `row_call` chose for its device, cap and options when they were bound.
`attend` and `attend_by_row` are the entries for everyone else (the EAGLE head, training, tests).

`CachedPositions.rollback(n)` is the one meaning of rollback for a static cache: keep the first n
cached positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from viasd_kernels import cpu_row_attention

from viasd_core.runtime import cpu_kernels



class LayerCache(torch.nn.Module):
    """One layer's K/V [1, kv_heads, length, head_dim] as buffers (static addresses for CUDA graphs).

    Each layer owns its tensors (not views of one big tensor): a compiled in-place write then
    stays in place instead of being functionalized into a copy of the whole cache.
    """

    def __init__(self, n_kv_heads: int, length: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (1, n_kv_heads, length, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [1, kv_heads, T, head_dim] at positions input_pos [T]; returns the buffers."""
        self.k[:, :, input_pos] = k
        self.v[:, :, input_pos] = v
        return self.k, self.v


class CachedPositions:
    """`seen` positions of a static cache are valid; the rest are stale and masked until overwritten."""

    seen: int = 0

    def rollback(self, n: int) -> None:
        """Keep the first `n` cached positions (`seen` becomes min(seen, n): rollback never grows the
        cache); the next forward overwrites the positions from there."""
        if n < 0:
            raise ValueError(f"rollback keeps a number of positions, got {n}")
        self.seen = min(self.seen, n)

    def reset(self) -> None:
        self.seen = 0


# ---------------------------------------------------------------------- masks
def causal_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[T, L] bool, True where query position query_pos[t] sees key position key_pos[l]: p <= q, and
    p > q - window under a sliding window. Computed on the device (no host read, compilable)."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask = mask & (key_pos[None, :] > query_pos[:, None] - window)
    return mask


def ttt_mask(n: int, step: int, device=None) -> torch.Tensor:
    """[n, (step + 1) * n] bool: the keys of drafting step `step` in the training-time test.

    The keys are those of steps 0..step over positions 0..n-1, concatenated (block k = step k's).
    Query q of step s (the s-th drafted token after anchor q - s) sees step 0's keys up to the anchor
    (p <= q - s) and, of each later step k = 1..s, the key at q - s + k (its own drafted prefix). Row
    q < s has no anchor (undefined, masked out of the loss); it still sees its own key, so no row is empty.
    """
    pos = torch.arange(n, device=device)
    blocks = [causal_mask(pos - step, pos)]
    blocks += [pos[None, :] == (pos - step + k)[:, None] for k in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


# ---------------------------------------------------------------------- the call
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over k, v [B, Hkv, L, D], Hq a multiple of Hkv.

    mask: [T, L] bool (True: attend), or that mask as `packed_mask` made it for these heads (additive,
    [rep * T, L]: a pass makes it once for all of its layers), or None (every key). scale: None is
    1/sqrt(D). softcap: the
    logits capped to tanh(s / softcap) * softcap before the softmax (Gemma 2), through operators
    as transformers' eager attention computes it (SDPA has no cap: `capped_attention`).
    Returns [B, T, Hq * D] (heads concatenated, ready for o_proj).
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.repeat(Hq // Hkv, 1)  # [rep * T, L]: rows follow the packed queries
    return packed_call(softcap)(q, k, v, mask, scale)


def packed_call(softcap: float | None = None) -> Callable:
    """The attention of a layer whose logits are capped at `softcap` (None: no cap), decided once:
    a call (q, k, v, mask, scale) -> [B, T, Hq * D] over a mask as `packed_mask` made it (or None),
    through SDPA, or with a cap through `capped_attention`'s operators. `attend` less its checks and
    the mask's packing: what a pass's layers call."""
    if softcap is None:
        return _sdpa_packed
    return lambda q, k, v, mask, scale: _capped_packed(q, k, v, mask, scale, softcap)


def _sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float | None) -> torch.Tensor:
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv * T, D), k, v, attn_mask=mask, scale=scale)
    return o.reshape(B, Hq, T, D).transpose(1, 2).reshape(B, T, Hq * D)  # [B, Hkv, rep * T, D] -> [B, T, Hq * D]


def _capped_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None, softcap: float) -> torch.Tensor:
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    o = capped_attention(q.reshape(B, Hkv, Hq // Hkv * T, D), k, v, mask, D**-0.5 if scale is None else scale, softcap)
    return o.reshape(B, Hq, T, D).transpose(1, 2).reshape(B, T, Hq * D)


def packed_mask(mask: torch.Tensor, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """What `attend` makes of the bool mask [T, L] at every call, made once for a pass's layers: its rows
    repeated for the `rep` query heads packed along the query axis, as an additive mask in the queries'
    `dtype` (0 where seen, -inf where not: SDPA's own conversion of a bool mask, so every output is
    bit for bit the same). A 768-token prefill of SmolLM2 repeated and converted its masks in 90
    layer calls (about 10% of an int4 prefill's time at one thread)."""
    return torch.where(mask, 0.0, float("-inf")).to(dtype).repeat(rep, 1)


def attend_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, window: int | None = None,
                  scale: float | None = None, key_mask: torch.Tensor | None = None,
                  kernels: Path | None = None, softcap: float | None = None, row_kernel: bool = True) -> torch.Tensor:
    """Causal attention of q [1, Hq, T, D] at positions end - T .. end - 1 over a cache k, v
    [1, Hkv, >= end, D], each row over exactly its keys and computed as it would be alone:
    [1, T, Hq * D]. With `key_mask` [T, end] (a token tree's rows) row i reads the slots it marks,
    in cache order. One kernel call on a CPU (viasd_kernels.cpu_row_attention), else the reference;
    always the reference with a `softcap` (the kernel has no cap): each row alone through operators.
    `kernels`: the kernels' folder (cpu_kernels.folder(), which a pass looks up once for its layers);
    `row_kernel` False: the reference. The call `row_call` chooses for these tensors' device."""
    return row_call(q.device, softcap, row_kernel and q.shape[0] == 1)(q, k, v, end, window, scale, key_mask, kernels)


def row_call(device: torch.device, softcap: float | None = None, row_kernel: bool = True) -> Callable:
    """`attend_by_row` for a layer on `device` with logits capped at `softcap`, decided once: a call
    (q, k, v, end, window, scale, key_mask, kernels) through viasd_kernels' row-invariant kernel on a
    CPU where there is no cap and `row_kernel` holds (the reference where the kernel does not take
    the tensors: not built here, or a head width it does not run), else the reference."""
    if row_kernel and softcap is None and device.type == "cpu":
        return _by_row_kernel
    return lambda q, k, v, end, window, scale, key_mask, kernels: attend_by_row_reference(
        q, k, v, end, window, scale, key_mask, softcap)


def _by_row_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, window: int | None,
                   scale: float | None, key_mask: torch.Tensor | None, kernels: Path | None) -> torch.Tensor:
    out = cpu_kernels.row_attention(q, k, v, end, window, scale, key_mask, build_dir=kernels)
    return out if out is not None else attend_by_row_reference(q, k, v, end, window, scale, key_mask)


def by_row_way(row_kernel: bool = True) -> str:
    """How `attend_by_row` runs on this CPU, and why (viasd doctor shows it); `row_kernel` False: the
    kernel turned off (a model's bind_kernels option)."""
    if not row_kernel:
        return "one call a position (the kernel is turned off)"
    probe = torch.zeros(1, 1, 1, cpu_row_attention.LANES)
    if cpu_kernels.row_attention(probe, probe, probe, 1) is not None:
        return "viasd_kernels' row-invariant kernel, one call a layer (built for this CPU)"
    return f"one call a position: {cpu_row_attention.why_not()}"


def attend_by_row_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, window: int | None = None,
                            scale: float | None = None, key_mask: torch.Tensor | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """`attend_by_row` as one `attend` call per position over exactly its keys (no mask): [B, T, Hq * D].
    A tree row's keys are gathered with one host read per row (an eager path)."""
    T = q.shape[2]
    outs = []
    for i in range(T):
        if key_mask is not None:
            keys = key_mask[i].nonzero().squeeze(1)
            k_i, v_i = k.index_select(2, keys), v.index_select(2, keys)
        else:
            stop = end - T + i + 1
            lo = 0 if window is None else max(0, stop - window)
            k_i, v_i = k[:, :, lo:stop], v[:, :, lo:stop]
        outs.append(attend(q[:, :, i : i + 1], k_i, v_i, None, scale, softcap))
    return torch.cat(outs, dim=1)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float) -> torch.Tensor:
    """softmax(tanh(q k^T * scale / softcap) * softcap) v over q [B, H, M, D], k, v [B, H, L, D] (mask
    [M, L], True: attend; or additive, from `packed_mask`), in transformers' eager order: the cap, then the
    mask, the softmax in float32."""
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
