"""The float32 matrix products of a short pass on a CPU, read at the memory's speed.

A short pass (a decoded token, a verify block: at most SHORT_ROWS rows) multiplies every weight by a
few rows, so its time is the time it takes to read the weights. On the CPU we measured (a 2-core AMD
EPYC with AVX-512), PyTorch's float32 `linear` reads a layer's weight at about 11 GB/s for such a
pass, with one thread or two, while a plain sum reads 27-30 GB/s. The same product as a batched
matrix-vector product over CHUNKS blocks of the weight's rows (`torch.bmm(W.view(c, N / c, K), x.T)`)
reads 20 GB/s on one thread and 23 GB/s on two (docs/benchmarks.md section 17). SmolLM2's float32
1-token pass went from 57.8 ms to 25.2 ms (two threads), and from 55.3 ms to 28.6 ms with PyTorch,
oneDNN and MKL held to AVX2 on the same CPU.

Whether it pays depends on the machine: on one thread a wide pass is bound by arithmetic, and there
F.linear's kernel is the faster one (SmolLM2's 6-token pass: 100.9 ms vs 112.0). So `choose_rows` times a 1-token
and a 6-token pass both ways, at the session's thread count, and a model takes the blocked product for
passes of up to 1 row, up to SHORT_ROWS rows, or never (`FastModel.short_rows`). A session caches the
choice per machine, thread count and models; `viasd doctor` measures again.

`linear(x, layer, up_to)` takes the blocked path for a CPU float32 `nn.Linear` and at most `up_to`
rows, and is `layer(x)` (F.linear) otherwise, which is also the plain reference the tests compare it
with. `mlp` is the gated MLP of every supported family (down(act(gate(x)) * up(x))) over `linear`.

Rounding: the blocked product sums each output in another order than F.linear (a difference of
float32 rounding, ~1e-6 relative). F.linear's own rows already round differently with the number of
rows in a pass on a CPU, so this changes nothing about exactness: in float32 `sd` and `exact` match
`ar` token for token as before (tested), and a rounding flip needs a near-tie of that size.
"""

from __future__ import annotations


import torch

SHORT_ROWS = 16  # passes of up to this many rows (PASS_WIDTHS[-1]) take the blocked product
WIDE = 6  # the verify pass choose_rows times beside a 1-token pass
CACHE_VERSION = 1
CHUNKS = 4  # blocks of the weight's rows; 2-16 measured alike, 4 divides every layer of the supported families


def applies(layer: torch.nn.Module) -> bool:
    """Whether `layer` takes the blocked product for short passes: a CPU float32 nn.Linear whose
    (contiguous) weight's rows split into CHUNKS blocks."""
    return (type(layer) is torch.nn.Linear and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32 and layer.out_features % CHUNKS == 0
            and layer.weight.is_contiguous())


def linear(x: torch.Tensor, layer: torch.nn.Module, up_to: int = SHORT_ROWS) -> torch.Tensor:
    """`layer(x)` for x [..., in]; through the blocked product where the layer `applies` and x holds
    at most `up_to` rows."""
    rows = x.numel() // x.shape[-1]
    if rows > up_to or not applies(layer):
        return layer(x)
    w = layer.weight  # [N, K]
    n, k = w.shape
    x2 = x.reshape(rows, k)
    y = torch.bmm(w.view(CHUNKS, n // CHUNKS, k), x2.t().expand(CHUNKS, k, rows))  # [c, N / c, rows]
    y = y.permute(2, 0, 1).reshape(*x.shape[:-1], n)
    return y if layer.bias is None else y + layer.bias


def mlp(x: torch.Tensor, module: torch.nn.Module, up_to: int = SHORT_ROWS) -> torch.Tensor:
    """The gated MLP `module` (gate_proj, up_proj, down_proj, act_fn) applied to x, over `linear`."""
    if up_to == 0 or not all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return module(x)
    return linear(module.act_fn(linear(x, module.gate_proj, up_to)) * linear(x, module.up_proj, up_to),
                  module.down_proj, up_to)


def pick_rows(seconds: dict[tuple[str, int], float]) -> tuple[int, str]:
    """Up to how many rows the blocked product runs, from the measured seconds of a 1-token and a
    6-token pass each way ({("blocked" | "plain", width): s}): SHORT_ROWS where it is faster at
    both, 1 where only at one row, else 0 (never)."""
    faster = {w: seconds[("blocked", w)] < seconds[("plain", w)] for w in (1, WIDE)}
    rows = SHORT_ROWS if faster[1] and faster[WIDE] else 1 if faster[1] else 0
    shown = ", ".join(f"{w}-token {seconds[('blocked', w)] * 1e3:.1f} vs {seconds[('plain', w)] * 1e3:.1f} ms"
                      for w in (1, WIDE))
    return rows, f"{shown}, blocked vs F.linear"


def choose_rows(engine, key: dict | None = None, refresh: bool = False, repeats: int = 3) -> tuple[int, str]:
    """Time a 1-token and a WIDE-token pass of the first of the engine's models (target, slim,
    draft) whose output head `applies`, with the blocked product and without, and give every model
    and the drafter what `pick_rows` makes of them (Engine.set_short_rows): (rows, reason). Without
    such a model (a GPU, low-bit or bfloat16 weights) rows is 0.

    With `key` (what the session runs: models, format, dtype) the choice is cached per machine and
    thread count (devices.MachineRecord; `refresh` measures again): the timing costs about 2 s."""
    from viasd_core.decoding.pass_timing import time_passes
    from viasd_core.devices import MachineRecord

    timed = next((m for m in engine.all_models() if applies(m.lm_head)), None)
    record = MachineRecord("short-rows", engine.device, key, CACHE_VERSION) if key is not None else None
    cached = _cached(record.load()) if timed is not None and record is not None and not refresh else None
    if timed is None:
        rows, reason = 0, "no float32 layers on a CPU"
    elif cached is not None:
        rows, reason = cached
    else:
        seconds = {}
        for _ in range(2):  # interleaved rounds, each way's best kept
            for way, up_to in (("blocked", SHORT_ROWS), ("plain", 0)):
                timed.short_rows = up_to
                for w, s in time_passes(timed, (1, WIDE), context=64, repeats=repeats).items():
                    seconds[(way, w)] = min(s, seconds.get((way, w), float("inf")))
        rows, reason = pick_rows(seconds)
        if record is not None:
            record.store({"rows": rows, "reason": reason})
    engine.set_short_rows(rows)
    return rows, reason


def _cached(data: dict | None) -> tuple[int, str] | None:
    """(rows, reason) of a stored choice; None when there is none or its fields do not fit (measured again)."""
    try:
        rows = int(data["rows"])
        if rows not in (0, 1, SHORT_ROWS):
            return None
        return rows, str(data["reason"]) + " (cached)"
    except (ValueError, KeyError, TypeError):
        return None
