"""A test model with per-request recurrent state beside attention (proves the state-pool seam).

`RecurrentDecoder` is a tiny dense decoder whose embeddings first pass through a gated linear
recurrence, h_t = a * h_{t-1} + x_t, x_t <- x_t + tanh(h_t W), per request. The model keeps no
state of its own between forwards: `h` lives in the engine's state pool (declared through
`cache_specs()`), read at the start of each request's chunk and written back at its end, so
pauses, evictions, forks and suspends are right only if the engine moves the state right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.cache.specs import StateSpec
from inference.models.dense.decoder import DenseDecoder
from inference.models.loading import load_from_hf_model
from inference.models.protocol import StateBatch


class RecurrentDecoder(DenseDecoder):
    """A dense decoder with a recurrent mixer on its embeddings (see module docstring)."""

    def __init__(self, base: DenseDecoder, seed: int = 0) -> None:
        super().__init__(base.spec, base.named_tensors(), backend=base.backend)
        hidden = base.spec.hidden_size
        gen = torch.Generator().manual_seed(seed)
        self.decay = torch.rand(hidden, generator=gen) * 0.9  # in [0, 0.9): a fading memory
        self.mix = torch.randn(hidden, hidden, generator=gen) * 2.0 / hidden**0.5

    @classmethod
    def from_hf(cls, hf_model) -> RecurrentDecoder:
        return cls(load_from_hf_model(hf_model))

    def cache_specs(self):
        return [*super().cache_specs(), StateSpec("h", (self.spec.hidden_size,), self.spec.dtype)]

    @torch.no_grad()
    def forward(self, input_ids, positions, kv_cache, meta, logits_indices, *, states: StateBatch | None = None):
        if states is None:
            raise ValueError("RecurrentDecoder needs its state rows (states=)")
        x = F.embedding(input_ids, self._embed)
        h_all = states.tensors["h"]
        bounds = meta.query_start_loc.tolist()
        for b, (slot, fresh) in enumerate(zip(states.slots.tolist(), states.fresh.tolist())):
            h = torch.zeros_like(h_all[slot]) if fresh else h_all[slot].clone()
            for t in range(bounds[b], bounds[b + 1]):
                h = self.decay * h + x[t]
                x[t] = x[t] + torch.tanh(h @ self.mix)
            h_all[slot] = h
        return self.decode_layers(x, positions, kv_cache, meta, logits_indices)
