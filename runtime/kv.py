"""Static KV cache: preallocated per-layer K/V buffers, a committed length, rollback to any shorter length.

Rows past `length` may hold stale data from a rejected window; every attention reads only slots
`0..start+T-1` after writing `start..start+T-1`, so stale rows are never seen (rollback leaves no trace).
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}.")
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.k: Tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.v: Tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.batch, self.length = capacity, batch, 0

    def rollback(self, length: int) -> None:
        """Forget everything at or after `length` (a committed length, never longer than what was written)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} positions.")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def committed(self) -> tuple[Tensor, Tensor]:
        """Views of the valid rows (tests compare these)."""
        return self.k[:, :, :, : self.length], self.v[:, :, :, : self.length]
