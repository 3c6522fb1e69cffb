"""The float32 matrix products of a short pass on a CPU, read at the memory's speed.

A short pass (a decoded token, a verify block: at most SHORT_ROWS rows) multiplies every weight by a
few rows, so its time is the time it takes to read the weights. PyTorch's float32 `linear` does not
read them at that speed on the CPUs we measured: for one row it reads ~11 GB/s where a plain sum
reads 27-30 GB/s (a 2-core AMD EPYC with AVX-512), and for 6-16 rows it packs the weight again at
every call. Two products do better, each where it is best (docs/experiments/fp32-short-passes-blocked.md and docs/experiments/fp32-onednn-packed-on-policy-head.md):

- **blocked**: a batched matrix-vector product over CHUNKS blocks of the weight's rows
  (`torch.bmm(W.view(c, N / c, K), x.T)`): ~31 GB/s for 1-4 rows on an AVX-512 BF16 EPYC (a plain
  sum: 41 GB/s), but it slows past 4 rows, to about F.linear's speed at 16.
- **packed**: oneDNN's product over a copy of the weight reordered once for it
  (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's frozen CPU graphs use): about the
  blocked product's speed for 1-4 rows, and 1.4-2.1x its speed for 6-16 rows. The copy doubles
  the float32 layers' memory; it is made on a layer's first packed call and kept while the layer
  lives (made again if the weight changes). A session does not take it where the copies would fill
  more than FREE_SHARE of the free memory (`packed_bytes`).

Which product a pass of r rows takes is a `ShortRows` value per model: the blocked product up to
`blocked` rows, the packed one above that up to `packed` rows, F.linear beyond (and for every pass
where neither applies), except that with `prefill` a prompt's chunks (long passes) take the packed
product too: PyTorch's float32 F.linear ran at about half the packed product's speed on the AMD EPYC
(a 768-token SmolLM2 prefill: 1.20 s against 0.67 s, docs/experiments/fp32-onednn-packed-on-policy-head.md).
`machine/short_rows.choose_rows` times a 1-, a 4- and a WIDE-token pass each way and a prefill chunk packed and plain,
at the session's thread count, and `pick_rows` composes the value; a session caches it per machine,
thread count and models, and `viasd doctor` measures again.

`eager_linear(x, layer, up_to, takes)` is `layer(x)` (F.linear: the plain reference the tests compare
both products with) wherever `up_to` gives it no other product, and `traced_linear` what a traced
pass runs; callers bind one or the other once (layer_calls.product: FastModel's layers and the EAGLE
head's, head_calls.py), so no call asks whether it is traced.

Row invariance: F.linear, the blocked and the packed product each round a row differently with the
number of rows in the pass (every row of SmolLM2-135M's float32 passes of 2-16 rows differed from the
same row decoded alone, by up to 1e-4 in a logit), so a model whose passes must give a position the
same logits in any pass (the target of `sd` and `exact`: FastModel.row_invariant) takes the
`invariant` way for its short passes instead: viasd_kernels' row-invariant float32 product
(`cpu_f32_mm`: each output's sum in one fixed order, whatever the pass's other rows and the thread
count), or, where that kernel cannot run (no C compiler, another dtype), `by_row`: F.linear over one
row at a time (the same 1-row call for a position in any pass; exact, and as slow as the rows are
many). The blocked and packed products stay for models whose rows need not match (drafts, slim
views) and for prompt chunks (longer passes, computed alike in every mode).
"""

from __future__ import annotations


import weakref
from typing import NamedTuple

import torch
from viasd_kernels import cpu_f32_mm

from viasd_core.runtime import cpu_kernels

SHORT_ROWS = 16  # passes of up to this many rows (PASS_WIDTHS[-1]) are short
MID = 4  # the blocked product's last fast width on the CPUs measured
WIDE = 6  # the verify pass machine/short_rows.choose_rows times beside a 1-token and a MID-token pass
CHUNKS = 4  # blocks of the weight's rows; 2-16 measured alike, 4 divides every layer of the supported families
FREE_SHARE = 0.5  # the packed copies may take at most this share of the free memory
_F32 = torch.float32


class ShortRows(NamedTuple):
    """Which product a pass takes: the blocked one for passes of up to `blocked` rows, the packed one
    for longer passes of up to `packed` rows, F.linear for the rest, except that with `prefill` the
    long passes (more than SHORT_ROWS rows: a prompt's chunks) take the packed one too. An int n
    means (n, 0)."""

    blocked: int = 0
    packed: int = 0
    prefill: bool = False
    invariant: bool = False  # every short pass row-invariant (the model's own setting: FastModel.row_invariant)

    def way(self, rows: int) -> str:
        if self.invariant and rows <= SHORT_ROWS:
            return "invariant"
        if rows <= self.blocked:
            return "blocked"
        return "packed" if rows <= self.packed or (self.prefill and rows > SHORT_ROWS) else "plain"

    def describe(self) -> str:
        if self.invariant:
            parts = ["row-invariant up to 16 rows"]
        else:
            parts = [f"blocked up to {self.blocked} row{'s' if self.blocked > 1 else ''}"] if self.blocked else []
            if self.packed > self.blocked:
                parts.append(f"packed up to {self.packed}")
        if self.prefill:
            parts.append("packed prefill")
        return ", ".join(parts) or "F.linear"


PLAIN, BLOCKED, PACKED = ShortRows(0, 0), ShortRows(SHORT_ROWS, 0), ShortRows(0, SHORT_ROWS, prefill=True)
DEFAULT = ShortRows(1, 0)  # until a session measures: the blocked product for 1-row passes
_VALID = {(b, p, f, False) for b in (0, 1, MID, SHORT_ROWS) for p in (0, SHORT_ROWS) for f in (False, True)}  # as measured; `invariant` is the model's


def applies(layer: torch.nn.Module) -> bool:
    """Whether `layer` takes the blocked product for short passes: a CPU float32 nn.Linear whose
    (contiguous) weight's rows split into CHUNKS blocks."""
    return (type(layer) is torch.nn.Linear and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32 and layer.out_features % CHUNKS == 0
            and layer.weight.is_contiguous())


def packs(layer: torch.nn.Module) -> bool:
    """Whether `layer` can take the packed product: a CPU float32 nn.Linear, with oneDNN in this build."""
    return (type(layer) is torch.nn.Linear and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32 and torch.backends.mkldnn.is_available())


# layer -> ((weight's address, version), its reordered copy); an entry goes with its layer
_packed: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, int], torch.Tensor]]" = weakref.WeakKeyDictionary()


def packed_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """`layer`'s weight reordered for oneDNN's product (made on first use; again if the weight changed)."""
    w = layer.weight
    key = (w.data_ptr(), w._version)
    hit = _packed.get(layer)
    if hit is None or hit[0] != key:
        hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), SHORT_ROWS))
        _packed[layer] = hit
    return hit[1]


def packed_bytes(models) -> int:
    """Bytes the packed copies of `models`' float32 CPU layers take (FastModels; shared layers once)."""
    layers = {id(m): m for model in models for m in model.hf_model.modules() if packs(m)}
    return sum(m.weight.numel() * m.weight.element_size() for m in layers.values())


def as_short_rows(up_to: ShortRows | int) -> ShortRows:
    """`up_to` as ShortRows (an int n: the blocked product up to n rows, ShortRows(n))."""
    return ShortRows(up_to) if isinstance(up_to, int) else up_to


# layer -> ((weight's address, version), its row-invariant product, or None where the kernel does not take it)
_invariant: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, int], object]]" = weakref.WeakKeyDictionary()


def invariant_product(layer: torch.nn.Linear):
    """`layer`'s row-invariant float32 product (viasd_kernels.cpu_f32_mm, bound on first use and again
    when the weight changes), or None where the kernel does not take it or cannot run here."""
    w = layer.weight
    key = (w.data_ptr(), w._version)
    hit = _invariant.get(layer)
    if hit is None or hit[0] != key:
        bias = None if layer.bias is None else layer.bias.detach()
        hit = (key, cpu_kernels.f32_mm(w.detach(), bias))
        _invariant[layer] = hit
    return hit[1]


def invariant_way() -> str:
    """How a row-invariant model's float32 short passes multiply on this machine, and why (doctor)."""
    if cpu_kernels.f32_mm(torch.zeros(16, 16)) is not None:
        bits = cpu_kernels.f32_mm_vector_bits()
        return f"viasd_kernels' row-invariant float32 product ({bits}-bit vectors, built for this CPU)"
    return f"F.linear one row at a time (row-invariant): {cpu_f32_mm.why_not() or 'the kernel does not run here'}"


def by_row(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """`layer(x)` one row at a time: each row through the same 1-row call in a pass of any width (the
    row-invariant products' plain reference, and their fallback)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.cat([layer(x2[i : i + 1]) for i in range(x2.shape[0])])
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _invariant_linear(x: torch.Tensor, layer: torch.nn.Module, kernel: bool,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """A short pass's product, each row as it would be alone: a float nn.Linear through the kernel
    (`kernel`: the layer is a float32 CPU nn.Linear, which it may take; `residual` added as it
    stores, where it is a contiguous float32 tensor of the output's shape: bit for bit PyTorch's add)
    or one row at a time; any other layer (an int8/int4 PackedLinear, whose kernels compute each row
    alike at any row count) is called as it is. `residual` (None: none) is added to the product."""
    if type(layer) is torch.nn.Linear and kernel and not (
            torch.is_grad_enabled() and (layer.weight.requires_grad or x.requires_grad
                                         or (residual is not None and residual.requires_grad))):
        bound = invariant_product(layer)
        if bound is not None:
            if (residual is not None and residual.dtype is _F32 and residual.is_contiguous()
                    and residual.shape[:-1] == x.shape[:-1] and residual.shape[-1] == bound.n):
                return bound(x.contiguous(), residual)
            y = bound(x.contiguous())
            return y if residual is None else residual + y
    y = layer(x) if type(layer) is not torch.nn.Linear else by_row(x, layer)
    return y if residual is None else residual + y


def _blocked(x: torch.Tensor, layer: torch.nn.Linear, rows: int) -> torch.Tensor:
    w = layer.weight  # [N, K]
    n, k = w.shape
    x2 = x.reshape(rows, k)
    y = torch.bmm(w.view(CHUNKS, n // CHUNKS, k), x2.t().expand(CHUNKS, k, rows))  # [c, N / c, rows]
    y = y.permute(2, 0, 1).reshape(*x.shape[:-1], n)
    return y if layer.bias is None else y + layer.bias


def _cpu_float32(layer: torch.nn.Module) -> bool:
    return (type(layer) is torch.nn.Linear and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32)


def eager_linear(x: torch.Tensor, layer: torch.nn.Module, up_to: ShortRows, takes,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """`layer(x)` in an eager pass, through the product `up_to` gives a pass of x's rows where the
    layer takes it: `takes(way)` says whether it does ("blocked": `applies`, "packed": `packs`,
    "invariant": the row-invariant kernel may, a float32 CPU nn.Linear), decided from the layer's
    weight, not from x (whose dtype and device are the layer's). The packed product only outside
    autograd. With `residual`: `residual + layer(x)` (inside the row-invariant kernel's call where
    it takes it, bit for bit the same)."""
    rows = x.numel() // x.shape[-1]
    way = up_to.way(rows)
    if way == "invariant":
        return _invariant_linear(x, layer, takes("invariant"), residual)
    y = _eager_way(x, layer, way, rows, takes)
    return y if residual is None else residual + y


def _eager_way(x: torch.Tensor, layer: torch.nn.Module, way: str, rows: int, takes) -> torch.Tensor:
    if way == "plain":
        return layer(x)
    if way == "packed":
        if takes("packed") and not (torch.is_grad_enabled() and (layer.weight.requires_grad or x.requires_grad)):
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), packed_weight(layer), layer.bias,
                                                   "none", [], "")
            return y.reshape(*x.shape[:-1], layer.out_features)
        return layer(x)
    return _blocked(x, layer, rows) if takes("blocked") else layer(x)


def traced_linear(x: torch.Tensor, layer: torch.nn.Module, up_to: ShortRows) -> torch.Tensor:
    """`layer(x)` as torch.compile traces it: the blocked product where `up_to` gives it a pass of
    x's rows and the layer takes it, else the layer (the packed product's oneDNN calls and the
    row-invariant kernel do not trace; a graph rounds by its width anyway, so `invariant` is ignored)."""
    rows = x.numel() // x.shape[-1]
    if up_to._replace(invariant=False).way(rows) == "blocked" and applies(layer):
        return _blocked(x, layer, rows)
    return layer(x)


TAKES = {"blocked": applies, "packed": packs, "invariant": _cpu_float32}


def takes_of(layer: torch.nn.Module):
    """`eager_linear`'s `takes` for `layer`, decided now from its weight (a model binds its products
    once: layer_calls.product)."""
    return {way: bool(test(layer)) for way, test in TAKES.items()}.__getitem__


def gated(module: torch.nn.Module) -> bool:
    """Whether `module` is a gated MLP (gate_proj, up_proj, down_proj, act_fn)."""
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


WAYS = {"blocked": BLOCKED, "packed": PACKED, "plain": PLAIN}
TIMED = (1, MID, WIDE)


def pick_rows(seconds: dict[tuple[str, int], float]) -> tuple[ShortRows, str]:
    """Which product each pass takes, from the measured seconds of a 1-, a MID- and a WIDE-token
    pass each way ({("blocked" | "packed" | "plain", width): s}; "packed" may be missing), and of a
    prefill chunk (a width over SHORT_ROWS) packed and plain where timed: the fastest way at each
    timed short width, held from there to the next. The blocked product runs up to the widest of 1
    and MID where it is fastest there and below, or every short pass where it is fastest at WIDE
    too; the packed one runs above that wherever it is fastest at some timed width; prefill chunks
    take the packed product where it was faster for one."""
    ways = [w for w in WAYS if (w, 1) in seconds]
    best = {w: min(ways, key=lambda way: seconds[(way, w)]) for w in TIMED}
    blocked = 0
    for w in TIMED:
        if best[w] != "blocked":
            break
        blocked = SHORT_ROWS if w == WIDE else w
    packed = SHORT_ROWS if "packed" in best.values() and blocked < SHORT_ROWS else 0
    shown = "; ".join(f"{w}-token " + ", ".join(f"{way} {seconds[(way, w)] * 1e3:.1f}" for way in ways) + " ms"
                      for w in TIMED)
    long = next((w for way, w in seconds if w > SHORT_ROWS and way == "packed" and ("plain", w) in seconds), None)
    prefill = long is not None and seconds[("packed", long)] < seconds[("plain", long)]
    if long is not None:
        shown += f"; {long}-token prefill chunk packed {seconds[('packed', long)] * 1e3:.0f}, plain {seconds[('plain', long)] * 1e3:.0f} ms"
    return ShortRows(blocked, packed, prefill), shown
