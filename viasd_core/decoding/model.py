"""A lean batch-1 decoder forward with a static KV cache, over a transformers model's weights.

`FastModel` runs the layers of a Hugging Face decoder-only model (the families of families.py:
Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3/4, Qwen3-MoE) without the framework's per-call
machinery, in the shape a compiler and CUDA graphs need (gpt-fast style):

- the KV cache is allocated once (`max_len` positions plus a little slack for padded passes)
  as module buffers; a pass writes its positions by index at DEVICE positions, so a
  captured graph never bakes in a Python integer position;
- compiled, attention reads the whole cache with a mask computed in the graph from the positions
  (one static shape); eager, it reads `cache[:end]`. Rolling back after a rejected draft is a length
  reset (`rollback(n)`): stale entries are masked, then overwritten;
- compiled, short passes are padded to a few fixed widths (`PASS_WIDTHS`): one graph per width,
  whatever the draft length; long passes (prefill) run in fixed-size chunks, eagerly;
- attention, its masks and grouped-query packing are attention.py's, shared with the EAGLE head.

`compile()` wraps the one pass function in `torch.compile(fullgraph=True)` (CUDA graphs on CUDA);
the eager path is the same function uncompiled: the plain reference the tests compare against.
With VIASD_CHECK_GRAPH_OUTPUTS=1 every compiled call poisons the outputs of the earlier ones, as
CUDA graph trees may overwrite them (graph_outputs.py): a CPU run then shows a stale read.

`capture_features(layers)` makes every pass also write the residual-stream states entering those
layers (transformers' `output_hidden_states[l]`) into a static buffer at the pass's positions, the
features an EAGLE-3 head drafts from: no extra pass, no host read.

The same class is the **slim verifier**: pass `layer_ids` to run a subset of the layers. It
holds references to the target's modules (embedding, kept layers, norm, lm_head), so it
shares every weight and costs only its own KV cache.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from viasd_kernels import cpu_layer, cpu_rms_norm, cpu_rope_write

from viasd_core import paths
from viasd_core.errors import ViasdError
from viasd_core.decoding import attention, graph_outputs
from viasd_core.decoding.families import (SUPPORTED_FAMILIES, ModelShape, check_embedding, final_softcap,  # noqa: F401
                                          model_shape, rope_tables, softcap, window)
from viasd_core.decoding.rope import apply_rope, signed_sin
from viasd_core.decoding.pass_widths import PASS_WIDTHS, pass_width
from viasd_core.decoding.short_products import DEFAULT, ShortRows
from viasd_core.decoding.tree_pass import TreePasses
from viasd_core.decoding.fused_projections import fused
from viasd_core.decoding.layer_calls import Call, LayerCalls, layer_calls, product
from viasd_core.decoding.norms import norm_calls
from viasd_core.decoding.weight_formats import PackedLinear, has_weight_format, widen_once

PREFILL_CHUNK = 256  # longer passes run in chunks of this many positions (bounded memory)


class StaticCache(torch.nn.Module):
    """Every run layer's K/V and the RoPE tables, allocated once: `cos`, `sin_signed` the first
    table, `cos_1`, `sin_signed_1`, ... any other (families.rope_tables: Gemma 3's sliding layers)."""

    def __init__(self, n_layers: int, n_kv_heads: int, length: int, head_dim: int, tables, dtype, device):
        super().__init__()
        self.layers = torch.nn.ModuleList(attention.LayerCache(n_kv_heads, length, head_dim, dtype, device)
                                          for _ in range(n_layers))
        for i, (cos, sin) in enumerate(tables):
            tail = f"_{i}" if i else ""
            self.register_buffer("cos" + tail, cos, persistent=False)  # [length, rotary dim]
            self.register_buffer("sin_signed" + tail, signed_sin(sin), persistent=False)  # as apply_rope takes it
        self.tables = len(tables)
        self.register_buffer("key_pos", torch.arange(length, device=device), persistent=False)
        self.register_buffer("features", None, persistent=False)  # [length, n * hidden] once features are captured


@dataclass(frozen=True, slots=True)
class LayerKernels:
    """The C kernels an eager CPU pass calls for one layer, bound once to one cache's buffers and the
    layer's weights (FastModel.bind_kernels): RoPE with the cache writes (viasd_kernels.cpu_rope_write)
    and an int4 layer's front half in one call (viasd_kernels.cpu_layer); None: PyTorch's operators."""
    writer: cpu_rope_write.RopeWriter | None = None
    front: cpu_layer.LayerFront | None = None


OPERATORS = LayerKernels()  # traced passes, devices other than the CPU: every call through operators


@dataclass(frozen=True, slots=True)
class PassCalls:
    """The calls a pass makes around its C kernels, decided once (FastModel.bind_kernels): each
    layer's (layer_calls.py), the final norm's and the output head's. A model holds one set for its
    eager passes and one for its traced passes (PyTorch's operators only); the pass is handed the
    set it runs, and no call asks which it is in."""
    layers: list[LayerCalls]
    final_norm: Call
    head: Call


class FastModel(attention.CachedPositions, TreePasses):
    """Batch-1 forward with a preallocated KV cache over (a subset of) a HF model's layers.

    `seen` is the number of positions whose K/V are valid in the cache; `rollback(n)` keeps the
    first n (attention.CachedPositions). `forward(ids, start)` writes positions [start, start + T)
    and returns logits for the last `n_logits` of them.
    """

    def __init__(self, hf_model, layer_ids: list[int] | None = None, max_len: int = 2048, name: str = "target"):
        self.hf_model = hf_model
        self.shape = model_shape(hf_model)
        self.name = name
        decoder = hf_model.get_decoder()
        self.embed = decoder.embed_tokens
        check_embedding(self.shape.family, self.embed)
        self.norm = decoder.norm
        self.final_softcap = final_softcap(hf_model.config)  # Gemma 2: logits capped by tanh
        self.lm_head = hf_model.get_output_embeddings()
        all_layers = list(decoder.layers)
        if layer_ids is None:
            layer_ids = list(range(len(all_layers)))
        if not layer_ids or any(not 0 <= i < len(all_layers) for i in layer_ids):
            raise ValueError(f"layer_ids must be non-empty indices below {len(all_layers)}, got {layer_ids}")
        self.layer_ids = sorted(layer_ids)
        self.layers = [all_layers[i] for i in self.layer_ids]
        self.windows = [window(self.shape.family, hf_model.config, layer) for layer in self.layers]
        param = next(hf_model.parameters())
        self.device = param.device
        # Quantized weights (bitsandbytes) report uint8/int8: the activations use the compute dtype.
        self.dtype = param.dtype if param.dtype.is_floating_point else getattr(hf_model, "dtype", torch.float32)
        if not self.dtype.is_floating_point:
            self.dtype = torch.float32
        self.quantized = getattr(hf_model, "hf_quantizer", None) is not None  # bitsandbytes
        self.weight_format = has_weight_format(hf_model)  # int8/int4 weight-only (weight_formats.PackedLinear)
        # Whether eager short passes are row-invariant, so that plain decoding and block verification
        # compute the same numbers (sd == ar): attention by row, products that compute each row alike
        # at any row count. Not bitsandbytes (its CPU kernels round by row count) nor CUDA (not
        # measured); a slim view turns it off. docs/exactness.md says why and what was measured.
        self._short_rows = DEFAULT
        self.row_attention = not self.quantized and self.device.type != "cuda"
        # int8/int4 on CPU: q/k/v and gate/up as one product each (fused_projections.py)
        cpu_packed = self.weight_format and self.device.type == "cpu"
        self._fused = [fused(layer) if cpu_packed else None for layer in self.layers]
        self.layer_front = True  # bind_kernels' options: int4 layers' front half in one C call where it applies,
        self.rope_kernel = True  # RoPE and the cache writes in one C call where it applies
        self._operators = [OPERATORS] * len(self.layers)  # the C kernels a traced pass calls: none (`_traced_run`)
        # Float32 layers on CPU: which product short passes multiply through (short_products.ShortRows:
        # the weights read at the memory's speed). The blocked product for 1-row passes until a session
        # measures it (choose_rows); PLAIN: every product through the layers themselves (F.linear).
        # A row-invariant model's short passes take the invariant way whatever is set (`short_rows`).
        self.short_rows = DEFAULT
        self.vocab_limit: int | None = None  # logits at columns >= vocab_limit are -inf (None: no mask)
        self.max_len = 0
        self.seen = 0
        self.passes = 0  # forward passes run (tests and statistics read it)
        self.positions_run = 0  # real (unpadded) positions processed
        self._compiled = None
        self.compile_mode: str | None = None
        self.compile_dynamic = False
        # float16 only: [] bool on the device, True once a pass produced a non-finite logit. Set
        # without a host read; `check_finite` reads it once, at the end of a generation.
        self._nonfinite: torch.Tensor | None = None
        self.feature_layers: tuple[int, ...] = ()
        self._capture: list[list[int]] = [[] for _ in range(len(self.layers) + 1)]
        self.allocate(max_len)

    # ------------------------------------------------------------------ set-up
    @property
    def row_attention(self) -> bool:
        """Whether eager short passes are row-invariant (see __init__): attention by row, and the
        float layers' short products through short_products' `invariant` way."""
        return self._row_attention

    @row_attention.setter
    def row_attention(self, on: bool) -> None:
        self._row_attention = bool(on)
        self.pass_rows = self._short_rows._replace(invariant=self._row_attention)

    @property
    def short_rows(self):
        """The products short float passes take where rows need not match (short_products.ShortRows:
        measured per machine); `pass_rows` is what the passes use: the same, `invariant` while the
        model is row-invariant (a plain attribute, read at every product call)."""
        return self._short_rows

    @short_rows.setter
    def short_rows(self, rows) -> None:
        self._short_rows = ShortRows(rows) if isinstance(rows, int) else rows
        self.pass_rows = self._short_rows._replace(invariant=getattr(self, "_row_attention", False))

    def allocate(self, max_len: int) -> None:
        """Allocate the KV cache and RoPE tables for `max_len` positions (once; never shrinks).

        A larger request re-allocates and empties the cache (and drops compiled graphs, which
        hold the old buffers); the engine allocates once per session, for its whole context.
        """
        max_len = int(max_len)
        if max_len <= self.max_len:
            return
        s = self.shape
        length = max_len + PASS_WIDTHS[-1]  # slack: a padded pass may write past the end
        tables, self._rope_ix = rope_tables(self.hf_model, self.layer_ids, torch.arange(length, device=self.device),
                                            self.dtype)
        self.cache = StaticCache(len(self.layers), s.n_kv_heads, length, s.head_dim, tables, self.dtype, self.device)
        self.max_len = max_len
        self.seen = 0
        self._allocate_features()
        self.bind_kernels()
        if self._compiled is not None:
            self.compile(self.compile_mode, self.compile_dynamic)

    def _allocate_features(self) -> None:
        n = len(self.feature_layers)
        if n:
            self.cache.register_buffer("features", torch.zeros(self.cache.key_pos.shape[0], n * self.shape.hidden_size,
                                                               dtype=self.dtype, device=self.device), persistent=False)

    def capture_features(self, layers) -> None:
        """Write, in every pass, the states entering decoder layers `layers` (ascending; transformers'
        `output_hidden_states[l]`, 0 = the embedding output) at the pass's positions into
        `cache.features` [positions, len(layers) * hidden], concatenated in that order.

        Position p's features are valid while p < `seen` (they are written with its K/V). A model
        that skips layers (the slim verifier) captures, for layer l, the state entering its first
        run layer at or after l (its final state when none): its own residual stream at that depth.
        """
        layers = tuple(int(l) for l in layers)
        if layers == self.feature_layers:
            return
        if list(layers) != sorted(set(layers)) or not all(0 <= l < self.shape.n_layers for l in layers):
            raise ValueError(f"feature layers must be distinct ascending indices below {self.shape.n_layers}, got {list(layers)}")
        self.feature_layers = layers
        self._capture = [[] for _ in range(len(self.layers) + 1)]  # run-layer index -> feature slots read there
        for slot, l in enumerate(layers):
            point = next((ci for ci, lid in enumerate(self.layer_ids) if lid >= l), len(self.layers))
            self._capture[point].append(slot)
        self._allocate_features()
        self.seen = 0
        if self._compiled is not None:
            self.compile(self.compile_mode, self.compile_dynamic)

    def compile(self, mode: str | None = "default", dynamic: bool = False) -> bool:
        """torch.compile the pass function (fullgraph, static shapes); False where it cannot apply.
        `dynamic`: the pass's row count dynamic instead (an experiment: benchmarks/experiments/frozen_compile.py).

        bitsandbytes layers are not traceable: quantized models stay eager. int8/int4 models stay
        eager on CPU: there inductor's graphs round a position differently with the pass's width
        (a 1-token graph vs wider ones, up to 0.3 in a logit of SmolLM2), which would break sd ==
        ar, while the eager pass with `row_attention` is exact and as fast (int4 SmolLM2: 16.0 ms a
        token eager, 15.1 ms for the compiled 2-token pass that would be needed). On CUDA the
        default mode is "reduce-overhead" (CUDA graphs).
        """
        if not self.compilable:
            return False
        if mode == "default" and self.device.type == "cuda":
            mode = "reduce-overhead"
        self.compile_mode, self.compile_dynamic = mode, dynamic
        # Every FastModel shares `_run`'s code, whose graphs dynamo caches together: a session holds
        # up to 14 a model (the widths x one or all logit rows, token trees' masked passes), and a
        # calibration compiles a slim model per candidate view; the default limit of 8 refuses most.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
        # The cache's buffers are inputs mutated in place, never outputs: the output check spares them.
        self._compiled = graph_outputs.guard(torch.compile(self._traced_run, fullgraph=True, dynamic=dynamic, mode=mode),
                                             static=list(self.cache.buffers()))
        return True

    def uncompile(self) -> None:
        """Drop the compiled graphs: every pass runs eager again."""
        self._compiled = None
        self.compile_mode, self.compile_dynamic = None, False

    @property
    def compilable(self) -> bool:
        """Whether `compile` applies (see there): not bitsandbytes, not int8/int4 off CUDA."""
        return not (self.quantized or (self.weight_format and self.device.type != "cuda"))

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @contextlib.contextmanager
    def eager(self):
        """Run every pass eagerly inside the block; a compiled model keeps its graphs for after it
        (timing the two on the same model: compile_choice.py)."""
        compiled, self._compiled = self._compiled, None
        try:
            yield self
        finally:
            self._compiled = compiled

    @property
    def min_pass(self) -> int:
        """The fewest positions a pass covers (a cached one is re-fed to reach it): 2 where a
        1-token pass would round differently from a wider one, so that plain decoding and block
        verification compute the same numbers: on CPU bitsandbytes runs 1 token through another
        kernel (gemv). On CUDA 1-token passes are allowed (docs/engine.md says what is bit-exact there)."""
        return 2 if self.quantized and self.device.type != "cuda" else 1

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.cache.layers for t in (c.k, c.v))

    # ------------------------------------------------------------------ forward
    def _traced_run(self, *args) -> torch.Tensor:
        """`_run` as torch.compile traces it: every layer through PyTorch's operators, the calls
        bound for traced passes (the class's function: the graphs hold it, whatever a test or
        profiler puts on the instance)."""
        return FastModel._run(self, *args, plan=self._operators, calls=self._traced_calls)

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
        masks = []  # per chunk: window -> [rows, keys]; by_row slices its keys instead
        for lo, hi, end, chunk_masked, chunk_by_row in chunks:
            if key_mask is not None and not chunk_by_row:
                masks.append({window: key_mask for window in set(self.windows)})  # trees: no sliding window
            elif chunk_masked and not chunk_by_row:
                key_pos = cache.key_pos[:end]
                masks.append({w: attention.causal_mask(input_pos[lo:hi], key_pos, w) for w in set(self.windows)})
            else:
                masks.append({})
        captured: list = [None] * len(self.feature_layers)
        kernels = paths.kernel_dir() if self.device.type == "cpu" else None  # once a pass, not once a layer
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
            gate, up = gate_up.split(c.gate_up_split, dim=-1)
            return c.down(c.act(gate) * up, x)  # x + down_proj(...)
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
                q, k, v = qkv.split(c.qkv_split, dim=-1)
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
            o = attention.attend_by_row(q, k_cache, v_cache, end, self.windows[ci], c.scaling, key_mask, kernels,
                                        c.softcap)
        else:
            o = attention.attend(q, k_cache[:, :, :end], v_cache[:, :, :end], masks.get(self.windows[ci]),
                                 c.scaling, c.softcap)  # [1, T, Hq * D]
        x = c.o(o, x)  # x + o_proj(o)
        h = c.post_norm(x)
        if c.gate_up is not None:
            gate, up = c.gate_up(h).split(c.gate_up_split, dim=-1)
            return c.down(c.act(gate) * up, x)  # x + down_proj(...)
        return x + c.mlp(h)

    def layer_kernels_way(self) -> str | None:
        """How this model's eager CPU passes run their RMSNorms and RoPE (with the cache writes), and
        why (viasd doctor shows it); None off the CPU."""
        if self.device.type != "cpu":
            return None
        if self._final_norm != self.norm.forward:
            norm = "RMSNorm in one C call"
        else:
            weight = self.norm._parameters.get("weight")
            runs = weight is not None and cpu_rms_norm.bind(weight.detach(), 1e-6, build_dir=paths.kernel_dir())
            why = ("not the formula the kernel computes" if runs
                   else cpu_rms_norm.why_not() or "a weight it does not take")
            norm = f"RMSNorm through the module ({why})"
        if any(c.q_norm is not None for c in self._calls):
            rope = "RoPE through operators (per-head norms come first)"
        elif self.cache is not None and self.cache.cos.shape[-1] != self.shape.head_dim:
            rope = "RoPE through operators (partial rotary)"
        elif self.cache.kernels[0].writer is not None:
            rope = "RoPE and cache writes in one C call"
        else:
            rope = f"RoPE through operators ({cpu_rope_write.why_not() or 'the cache is not one the kernel takes'})"
        front = self.cache.kernels[0].front is not None
        return f"{norm}; {rope}" + ("; an int4 layer's calls up to its MLP in one C call" if front else "")

    def bind_kernels(self, layer_front: bool | None = None, rope_kernel: bool | None = None) -> None:
        """Bind the calls of every pass, once: each layer's, the final norm's and the head's, for
        eager passes (`_calls`, `_final_norm`, `_head`: the C kernels where they apply) and for
        traced ones (`_traced_calls`: PyTorch's operators), and the C kernels every layer's eager
        CPU passes call to the cache in use (`cache.kernels`, one LayerKernels a layer): the plan a
        pass follows. Done when the cache is allocated; call it again after replacing a layer's
        weights, or to set the options (`layer_front` False: an int4 layer's calls one by one;
        `rope_kernel` False: RoPE and the cache writes through operators, and so no layer front
        either: the tests' and benchmarks' references). A cache swapped in keeps the kernels bound
        to it."""
        if layer_front is not None:
            self.layer_front = bool(layer_front)
        if rope_kernel is not None:
            self.rope_kernel = bool(rope_kernel)
        pairs = list(zip(self.layers, self._fused))
        self._calls = [layer_calls(layer, f, self) for layer, f in pairs]  # layer_calls.py
        self._final_norm = norm_calls(self.norm).eager  # norms.py: one call on CPU
        self._head = product(self.lm_head, self)
        self._traced_calls = PassCalls([layer_calls(layer, f, self, traced=True) for layer, f in pairs],
                                       self.norm.forward, product(self.lm_head, self, traced=True))
        self.cache.kernels = [self._bind_layer(ci) for ci in range(len(self.layers))]

    def _bind_layer(self, ci: int) -> LayerKernels:
        if self.device.type != "cpu":
            return OPERATORS
        writer = None
        if self.rope_kernel and self._calls[ci].q_norm is None:  # Qwen3's per-head norms come first: operators
            layer_cache = self.cache.layers[ci]
            writer = cpu_rope_write.bind(layer_cache.k, layer_cache.v, build_dir=paths.kernel_dir())
        front = self._bind_front(ci, writer) if self.layer_front else None
        return LayerKernels(writer, front)

    def _bind_front(self, ci: int, writer) -> cpu_layer.LayerFront | None:
        c, fused = self._calls[ci], self._fused[ci]
        if (writer is None or not c.front or fused is None or self.cache.cos.shape[-1] != self.shape.head_dim
                or c.qkv is None or c.gate_up is None or self.dtype != torch.bfloat16):
            return None
        products = (fused.qkv, self.layers[ci].self_attn.o_proj, fused.gate_up)
        if any(type(m) is not PackedLinear or m._parameters.get("bias") is not None for m in products):
            return None
        bound = [m._short_product(m._buffers["qdata"], m._buffers["scale"]) for m in products]
        if any(b is None or b.n != m.out_features for b, m in zip(bound, products)):
            return None
        norms = [call if isinstance(call, cpu_rms_norm.Norm) else None for call in (c.input_norm, c.post_norm)]
        front = cpu_layer.bind(*norms, *bound,
                               writer, self.shape.n_heads, c.scaling, self.windows[ci], build_dir=paths.kernel_dir())
        return front

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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, n_logits: int = 1) -> torch.Tensor:
        """Run positions [start, start + T) and return float32 logits of the last `n_logits`.

        input_ids: [T] int64 on this model's device. Returns [n_logits, vocab] float32.
        """
        T = input_ids.shape[0]
        end = start + T
        if end > self.max_len:
            raise ViasdError(
                f"context of {end} tokens exceeds the {self.max_len} positions allocated for '{self.name}': "
                "raise --max-context or shorten the prompt"
            )
        if not 0 < n_logits <= T:
            raise ValueError(f"n_logits must be in [1, {T}], got {n_logits}")
        self.passes += 1
        self.positions_run += T
        width = pass_width(T) if T <= PASS_WIDTHS[-1] else 0
        n_rows = width if n_logits > 1 else 1  # a compiled pass returns 1 row or all of its rows
        if self._compiled is not None and (width, n_rows) in self.graph_shapes():
            out = self._compiled_pass(input_ids, start, T, width, n_logits)
        else:  # eager: exactly T positions over cache[:end] (a long one in chunks: `_run`)
            pos = torch.arange(start, end, device=self.device)
            rows = torch.arange(T - n_logits, T, device=self.device)
            by_row = self.row_attention and T <= PASS_WIDTHS[-1]  # a prompt's prefill attends at once
            out = self._run(input_ids, pos, rows, end, self._masked(T, end), by_row)
        if self.dtype == torch.float16:  # on the device: no read per pass
            bad = ~torch.isfinite(out[:, : self.vocab_limit]).all()
            self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad
        self.seen = end
        return out

    def check_finite(self) -> None:
        """Raise if any pass since the last check produced a non-finite logit (float16 overflow).
        One host read; the engine calls it once a generation."""
        if self._nonfinite is not None and bool(self._nonfinite):
            self._nonfinite = None
            raise ViasdError(f"'{self.name}' overflowed in float16 (non-finite logits): use --dtype float32, "
                             "or bfloat16 on a GPU that has it")

    def _compiled_pass(self, input_ids: torch.Tensor, start: int, T: int, W: int, n_logits: int) -> torch.Tensor:
        """A short pass padded to its fixed width W, attending over the whole cache (static shapes)."""
        # Padding tokens sit after the real ones: no real row attends to them. Always a new tensor
        # (made under inference mode), so every call hands the graph the same kind of input.
        input_ids = torch.cat([input_ids, input_ids.new_zeros(W - T)])
        pos = torch.arange(start, start + W, device=self.device)
        rows = torch.arange(T - 1, T, device=self.device) if n_logits == 1 else torch.arange(W, device=self.device)
        logits = self._compiled(input_ids, pos, rows, self.max_len)
        return logits if n_logits == 1 else logits[T - n_logits : T]

    @staticmethod
    def graph_shapes(max_width: int = PASS_WIDTHS[-1]) -> list[tuple[int, int]]:
        """(width, logit rows) of the compiled passes: every pass of up to 16 tokens. One logit row:
        a 1-token step or a catch-up padded to 2..16 (a draft after plain steps or accept tiers, the
        target after a block it did not verify, a chat turn); all rows: a verify block up to
        `max_width` (1 for a drafter's models). Over 16 tokens a pass stays an eager chunked prefill:
        its cost is in its positions, not in launches, and no fixed set of graphs covers every length."""
        return [(w, 1) for w in PASS_WIDTHS] + [(w, w) for w in PASS_WIDTHS[1:] if w <= max_width]

    def warm_up(self, max_width: int = PASS_WIDTHS[-1]) -> float:
        """Compile every graph of `graph_shapes(max_width)` now (none compiles mid-generation); returns seconds.

        Runs each shape once at positions 0.. (their cache entries are garbage, so the cache is
        emptied after). A no-op returning 0.0 when the model is not compiled.
        """
        if self._compiled is None:
            return 0.0
        t0 = time.perf_counter()
        ids = torch.zeros(PASS_WIDTHS[-1], dtype=torch.long, device=self.device)
        for width, n_rows in self.graph_shapes(max_width):
            self.forward(ids[:width], 0, n_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reset()
        self.passes = self.positions_run = 0
        return time.perf_counter() - t0

    def extend(self, ids: torch.Tensor, end: int, n_logits: int = 1) -> torch.Tensor:
        """Feed the positions [seen, end) of the token buffer `ids` and return the last logits."""
        # Positions whose logits are wanted but already cached are simply recomputed.
        start = max(0, min(self.seen, end - n_logits, end - self.min_pass))
        return self.forward(ids[start:end], start, n_logits=n_logits)
