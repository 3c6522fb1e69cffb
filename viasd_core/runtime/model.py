"""A lean batch-1 decoder forward with a static KV cache, over a transformers model's weights.

`FastModel` runs the layers of a Hugging Face decoder-only model (the families of families.py:
Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3/4, Qwen3-MoE) without the framework's per-call
machinery, in the shape a compiler and CUDA graphs need (gpt-fast style). This file adapts the HF
model (its modules, dtype and settings) and holds the pass's entry points (`forward`, `extend`);
each other idea is a file of its own, mixed into the class:

- the KV cache (kv_cache.py) is allocated once (`max_len` positions plus a little slack for padded
  passes) as module buffers; a pass writes its positions by index at DEVICE positions, so a
  captured graph never bakes in a Python integer position;
- the pass (model_pass.py): compiled, attention reads the whole cache with a mask computed in the
  graph from the positions (one static shape); eager, it reads `cache[:end]`. Rolling back after a
  rejected draft is a length reset (`rollback(n)`): stale entries are masked, then overwritten.
  Long passes (prefill) run in fixed-size chunks, eagerly; attention, its masks and grouped-query
  packing are attention.py's, shared with the EAGLE head;
- compiling (model_compile.py): short passes padded to a few fixed widths (`PASS_WIDTHS`), one
  graph per width, whatever the draft length;
- the calls and C kernels a pass makes, bound once (kernel_binding.py), and what doctor says of
  them (kernel_ways.py);
- `capture_features(layers)` (feature_capture.py): every pass also writes the states entering
  those layers, the features an EAGLE-3 head drafts from.

The same class is the **slim verifier**: pass `layer_ids` to run a subset of the layers. It
holds references to the target's modules (embedding, kept layers, norm, lm_head), so it
shares every weight and costs only its own KV cache.
"""

from __future__ import annotations

import torch

from viasd_core.errors import ViasdError
from viasd_core.runtime import attention
from viasd_core.runtime.families import (SUPPORTED_FAMILIES, ModelShape, check_embedding, final_softcap,  # noqa: F401
                                          model_shape, rope_tables, window)
from viasd_core.runtime.feature_capture import FeatureCapture
from viasd_core.runtime.kernel_binding import OPERATORS, KernelBinding
from viasd_core.runtime.kernel_ways import KernelWays
from viasd_core.runtime.kv_cache import StaticCache
from viasd_core.runtime.model_compile import CompiledPasses
from viasd_core.runtime.model_pass import DecoderPass
from viasd_core.runtime.pass_widths import PASS_WIDTHS, pass_width
from viasd_core.runtime.short_products import DEFAULT, ShortRows
from viasd_core.runtime.tree_pass import TreePasses
from viasd_core.runtime.fused_projections import fused
from viasd_core.runtime.weight_formats import has_weight_format


class FastModel(attention.CachedPositions, TreePasses, DecoderPass, CompiledPasses, KernelBinding, FeatureCapture,
                KernelWays):
    """Batch-1 forward with a preallocated KV cache over (a subset of) a HF model's layers.

    `seen` is the number of positions whose K/V are valid in the cache; `rollback(n)` keeps the
    first n (attention.CachedPositions). `forward(ids, start)` writes positions [start, start + T)
    and returns logits for the last `n_logits` of them. `fuse_projections` False: an int8/int4
    model's q/k/v and gate/up stay separate products on a CPU (the tests' reference).
    """

    def __init__(self, hf_model, layer_ids: list[int] | None = None, max_len: int = 2048, name: str = "target",
                 fuse_projections: bool = True):
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
        cpu_packed = self.weight_format and self.device.type == "cpu" and fuse_projections
        self._fused = [fused(layer) if cpu_packed else None for layer in self.layers]
        self.layer_front = True  # bind_kernels' options: int4 layers' front half in one C call where it applies,
        self.rope_kernel = True  # RoPE and the cache writes in one C call where it applies,
        self.row_kernel = True  # and attention by row in one C call a layer (attention.row_call)
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

    def extend(self, ids: torch.Tensor, end: int, n_logits: int = 1) -> torch.Tensor:
        """Feed the positions [seen, end) of the token buffer `ids` and return the last logits."""
        # Positions whose logits are wanted but already cached are simply recomputed.
        start = max(0, min(self.seen, end - n_logits, end - self.min_pass))
        return self.forward(ids[start:end], start, n_logits=n_logits)
