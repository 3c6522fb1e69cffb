"""Feature capture: a FastModel's passes also write the residual-stream states entering chosen
layers (transformers' `output_hidden_states[l]`) into a static buffer at the pass's positions, the
features an EAGLE-3 head drafts from: no extra pass, no host read."""

from __future__ import annotations

import torch


class FeatureCapture:
    """Mixed into FastModel (model.py): sets the layers its pass (model_pass.py) captures."""

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
