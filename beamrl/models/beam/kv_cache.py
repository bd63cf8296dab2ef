"""`KVCache`: the reference model's key/value cache for batched incremental decoding.

One slot axis shared by every layer: slot s of row b holds the token fed at that step (a left-padding token,
a prompt token or a generated one). Keys are stored after q/k-norm and RoPE, exactly as attention consumes
them. Visibility is decided from the stored absolute positions and the validity flags (padding is never
visible), so sliding-window and full layers read the same cache; the window is applied as a mask rather than by
evicting slots (the tiny CPU models never need the memory).
"""

from __future__ import annotations

import torch

from beamrl.models.beam.config import BeamConfig


class KVCache:
    """Per-layer K/V tensors [B, capacity, kv_heads, head_dim] plus per-slot position and validity [B, capacity].

    Create with `KVCache(config, batch, capacity, dtype, device)`; the model appends to it in place and grows
    it (doubling) when a forward needs more slots than `capacity`."""

    def __init__(self, config: BeamConfig, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if batch < 1 or capacity < 1:
            raise ValueError(f"KVCache needs batch >= 1 and capacity >= 1, got batch={batch}, capacity={capacity}")
        shape = (batch, capacity, config.num_key_value_heads, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.length = 0  # slots in use (same for every row)

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def num_valid(self) -> torch.Tensor:
        """Number of real (non-padding) tokens cached per row, [B] int64."""
        return self.valid[:, : self.length].sum(dim=1)

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more slots, doubling the capacity as needed."""
        need = self.length + new_tokens
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        grow = cap - self.capacity

        def pad(t: torch.Tensor) -> torch.Tensor:
            extra = torch.zeros((t.shape[0], grow) + tuple(t.shape[2:]), dtype=t.dtype, device=t.device)
            return torch.cat((t, extra), dim=1)

        self.keys = [pad(k) for k in self.keys]
        self.values = [pad(v) for v in self.values]
        self.positions = pad(self.positions)
        self.valid = pad(self.valid)

    def append_meta(self, positions: torch.Tensor, valid: torch.Tensor) -> slice:
        """Record positions/validity [B, T] of the tokens of this forward; returns their slot range.

        Call once per forward, before the layers write their K/V into `slots`."""
        t = positions.shape[1]
        if positions.shape[0] != self.batch:
            raise ValueError(f"KVCache holds {self.batch} rows but the forward has {positions.shape[0]}")
        self.reserve(t)
        slots = slice(self.length, self.length + t)
        self.positions[:, slots] = positions
        self.valid[:, slots] = valid
        self.length += t
        return slots

    def write(self, layer: int, slots: slice, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's k/v [B, T, kv_heads, D] of `layer`; return all cached k/v up to `length`."""
        self.keys[layer][:, slots] = k
        self.values[layer][:, slots] = v
        return self.keys[layer][:, : self.length], self.values[layer][:, : self.length]

    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only `rows` (e.g. the requests still decoding), in that order; drops the others' memory. A row may
        be named more than once (a shared prefill copied to each request of its prompt)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.positions.device)
        self.keys = [k.index_select(0, idx) for k in self.keys]
        self.values = [v.index_select(0, idx) for v in self.values]
        self.positions = self.positions.index_select(0, idx)
        self.valid = self.valid.index_select(0, idx)
