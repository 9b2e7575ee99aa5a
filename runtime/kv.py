"""Static KV cache: preallocated per-layer K/V buffers, a committed length, rollback to any shorter length.

Rows past `length` may hold stale data from a rejected window; every attention reads only slots
`0..start+T-1` after writing `start..start+T-1`, so stale rows are never seen (rollback leaves no trace).

The cache is held in the compute dtype, or in 8 bits as `q8_0` (docs/models.md, "KV cache"): each head vector is
cut into blocks of 32 values, each block stored as 32 int8 and one float16 scale `d` with `x = q * d`, GGUF's Q8_0
formula (`d = max|x| / 127`, `q = roundf(x / d)`). Quantized values and scales live in separate tensors (`k`, `v`
int8 `[L, B, nkv, S, hd]`; `k_scale`, `v_scale` float16 `[L, B, nkv, S, hd/32]`) so the kernels read each
contiguously. Reads return the compute dtype: `(q * d)` in fp32, rounded once.
"""

from __future__ import annotations

import torch
from torch import Tensor

Q8_BLOCK = 32
KV_QUANTS = ("q8_0",)

# The decode attention splits each row's context into chunks fixed by absolute position (docs/models.md,
# "Numerics"): chunks of 128 positions up to position 4096 (short contexts still spread over many programs), of 256
# up to 32768, of 1024 beyond (long contexts write and re-read fewer partials). A program's time is its longest chunk
# (64 positions a step) and the reduction's a few steps of 64 chunks, so short chunks pay up to where their count
# would outgrow the grid: H200, A3B one-row step (bench/step_ab.py, bench/results/h200_session9/), against the layout
# before (128 to 2048, 512 to 16384, 1024 beyond; 16 chunks a reduction step): 2.96 -> 2.71 ms at 4k, 3.23 -> 3.16 at
# 16k, 3.68 -> 3.62 at 32k, 1k unchanged. A constant layout, never chosen
# from the context, so a row's bits do not depend on the configured context either. Each (row, head, chunk) leaves
# fp32 partials: hd accumulators, a max and a sum. KV_TIERS = (C0, E0, C1, E1, C2): chunks of C0 positions on
# [0, E0), of C1 on [E0, E1), of C2 from E1 on (each E a multiple of the chunk before it); or four tiers,
# (C0, E0, C1, E1, C2, E2, C3): then C2 on [E1, E2) and C3 from E2 on (`tiers4`).
KV_TIERS: tuple[int, ...] = (128, 4096, 256, 32768, 1024)


# A window of one row over a compute-dtype cache (a target decoding alone: its engine's one width is 1, docs/models.md
# "Numerics") splits by a layout chosen from the row's own length n instead: ONE_ROW_CHUNKS = (T, CMIN, CMAX), chunks
# of C positions, C the least of CMIN, 2 CMIN, 4 CMIN, ... up to CMAX with T * C >= n: between T / 2 and T chunks a
# row at every length from T * CMIN / 2 to T * CMAX (one or two programs an SM on the A3B's 4 KV heads), where the
# fixed layout leaves short contexts few programs and long ones more than a wave. Still a function of the row's
# position only (its bits never depend on the capacity or on other rows); not the wider windows' layout (their rows
# share K/V tiles, so chunk boundaries). H100, A3B one-row step on 40,960-position caches (bench/step_ab.py arms ad*,
# bench/results/h100_session41/one_row_chunks/): against KV_TIERS 3.03 -> 2.92 ms at 1k, 3.04 -> 2.94 at 2k, 3.04 ->
# 3.02 at 4k (the same layout there), 3.23 -> 3.19 at 8k, 3.56 -> 3.49-3.51 at 16k, 4.13 -> 4.06 at 32k; 7.45 -> 7.14
# at 131k (a 131k cache). None: KV_TIERS for one row too.
ONE_ROW_CHUNKS: tuple[int, int, int] | None = (64, 32, 2048)
# the same for a one-row window over a q8_0 cache, None: the tiers. Its programs dequantize every tile, so it wants
# more of them than a BF16 cache's: ONE_ROW_CHUNKS itself made its step slower (H100, A3B, 4.36 -> 5.34 ms at 32k);
# layouts with more chunks (T 96 / 128 / 256, bench/step_ab.py arms q8ad*) were 1-2% faster up to 4k and 1-3% slower
# at 16k-131k (H100, bench/results/h100_session42/part8/): none wins everywhere
ONE_ROW_CHUNKS_Q8: tuple[int, int, int] | None = None


def one_row_layout(layout: tuple[int, ...] | None = None) -> tuple[int, int, int]:
    """(T, CMIN, CMAX) checked (None: ONE_ROW_CHUNKS as it is when called, which must be set)."""
    t = tuple(int(x) for x in (ONE_ROW_CHUNKS if layout is None else layout))
    if len(t) != 3 or t[0] < 1 or t[1] < 1 or t[2] < t[1] or t[2] % t[1] or (t[2] // t[1]) & (t[2] // t[1] - 1):
        raise ValueError(f"one-row chunk layout {t}: (chunks, least chunk, largest chunk) with the largest a "
                         "power-of-two multiple of the least; fix the layout.")
    return t


def one_row_chunk(n: int, layout: tuple[int, ...] | None = None) -> int:
    """Positions a chunk of a one-row window whose row holds n positions (the kernels' `_row_chunk`)."""
    t, c, cmax = one_row_layout(layout)
    while c < cmax and t * c < n:
        c *= 2
    return c


def one_row_chunks(capacity: int, layout: tuple[int, ...] | None = None) -> int:
    """The most chunks a one-row window has at any length up to capacity: T while chunks can grow, then
    capacity / CMAX."""
    t, cmin, cmax = one_row_layout(layout)
    n = max(1, int(capacity))
    return max(min(t, -(-n // cmin)), -(-n // cmax))


def tiers4(tiers: tuple[int, ...] | None = None) -> tuple[int, int, int, int, int, int, int]:
    """A layout as four tiers (C0, E0, C1, E1, C2, E2, C3), the kernels' form: three tiers get an empty third
    (E2 = E1, C3 = C2). None: KV_TIERS as it is when called."""
    t = tuple(int(x) for x in (KV_TIERS if tiers is None else tiers))
    if len(t) == 5:
        t = (*t, t[3], t[4])
    if len(t) != 7:
        raise ValueError(f"a KV chunk layout has 5 or 7 numbers, got {t}.")
    c0, e0, c1, e1, c2, e2, c3 = t
    if min(c0, c1, c2, c3) <= 0 or not 0 <= e0 <= e1 <= e2 or e0 % c0 or (e1 - e0) % c1 or (e2 - e1) % c2:
        raise ValueError(f"KV chunk layout {t}: each tier's end must follow the one before and be a whole number of "
                         "its chunks from there; fix the layout.")
    return t


def uniform_tiers(chunk: int) -> tuple[int, int, int, int, int]:
    """One chunk size everywhere, in the KV_TIERS form (checks compare layouts; a chunk >= S is no split)."""
    return (chunk, 0, chunk, 0, chunk)


def split_chunks(capacity: int, tiers: tuple[int, ...] | None = None) -> int:
    """Chunks of the split decode attention covering positions 0..capacity-1 (the kernels' `_n_chunks`; tiers
    None: KV_TIERS as it is when called)."""
    c0, e0, c1, e1, c2, e2, c3 = tiers4(tiers)
    n = int(capacity)
    if n <= e0:
        return -(-n // c0)
    if n <= e1:
        return e0 // c0 + -(-(n - e0) // c1)
    if n <= e2:
        return e0 // c0 + (e1 - e0) // c1 + -(-(n - e1) // c2)
    return e0 // c0 + (e1 - e0) // c1 + (e2 - e1) // c2 + -(-(n - e2) // c3)


def partial_chunks(rows: int, capacity: int) -> int:
    """Chunk slots a (row, head) of a `rows`-row split attention needs at up to `capacity` positions: KV_TIERS',
    and for one row ONE_ROW_CHUNKS' and ONE_ROW_CHUNKS_Q8's too where set (whichever cache the step reads)."""
    n = split_chunks(capacity)
    if rows == 1:
        n = max([n] + [one_row_chunks(capacity, lay) for lay in (ONE_ROW_CHUNKS, ONE_ROW_CHUNKS_Q8) if lay])
    return n


def split_partials_bytes(rows: int, heads: int, capacity: int, head_dim: int) -> int:
    """Scratch of one split decode attention: `rows * heads * chunks * (head_dim + 2) * 4` bytes."""
    return rows * heads * partial_chunks(rows, capacity) * (head_dim + 2) * 4


def kv_row_bytes(head_dim: int, elem_bytes: int, quant: str | None = None) -> int:
    """Bytes of one cached head vector (one position, one KV head, K or V)."""
    if quant is None:
        return head_dim * elem_bytes
    if quant == "q8_0":
        return head_dim + 2 * (head_dim // Q8_BLOCK)
    raise ValueError(f"unknown KV cache format {quant!r}; use one of {', '.join(KV_QUANTS)}.")


def quantize_q8_0(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., hd] -> (int8 [..., hd], float16 scales [..., hd/32]): GGUF Q8_0 bit for bit (round half away from
    zero, scale rounded to float16 after quantizing with the fp32 one)."""
    *lead, hd = x.shape
    b = x.float().reshape(*lead, hd // Q8_BLOCK, Q8_BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    v = b * inv
    a = v.abs()
    f = torch.floor(a)
    r = f + torch.floor(2 * (a - f))
    q = torch.where(v < 0, -r, r).to(torch.int8)
    return q.reshape(*lead, hd), d[..., 0].to(torch.float16)


def dequantize_q8_0(q: Tensor, d: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """int8 [..., hd] and float16 scales [..., hd/32] -> `dtype` [..., hd] (`q * d` in fp32, rounded once)."""
    *lead, hd = q.shape
    x = q.reshape(*lead, hd // Q8_BLOCK, Q8_BLOCK).float() * d.float()[..., None]
    if out is None:
        return x.reshape(*lead, hd).to(dtype)
    out.copy_(x.reshape(*lead, hd))
    return out


class LayerKV:
    """One layer's slice of a `KVCache` (all batch rows): what attention writes to and reads from."""

    def __init__(self, cache: KVCache, i: int) -> None:
        self.cache, self.i = cache, i
        self.k, self.v = cache.k[i], cache.v[i]                      # [B, nkv, S, hd]
        self.k_scale = None if cache.k_scale is None else cache.k_scale[i]
        self.v_scale = None if cache.v_scale is None else cache.v_scale[i]

    @property
    def quant(self) -> str | None:
        return self.cache.quant

    def write(self, k: Tensor, v: Tensor, start: int) -> None:
        """k, v [B, nkv, T, hd] into slots start..start+T-1."""
        end = start + k.shape[2]
        if self.quant is None:
            self.k[:, :, start:end] = k.to(self.k.dtype)
            self.v[:, :, start:end] = v.to(self.v.dtype)
            return
        qk, sk = quantize_q8_0(k)
        qv, sv = quantize_q8_0(v)
        self.k[:, :, start:end], self.k_scale[:, :, start:end] = qk, sk
        self.v[:, :, start:end], self.v_scale[:, :, start:end] = qv, sv

    def read(self, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Keys and values of slots 0..end-1 as [B, nkv, end, hd] in `dtype`. Quantized: dequantized into the
        cache's scratch (one layer at a time; a Triton kernel on CUDA, torch elsewhere)."""
        if self.quant is None:
            return self.k[:, :, :end].to(dtype), self.v[:, :, :end].to(dtype)
        ks, vs = self.cache.dequant_scratch(dtype)
        ko, vo = ks[:, :, :end], vs[:, :, :end]
        from runtime.gpu import attention_kernels, kernels

        if kernels.available(self.k):
            for b in range(self.k.shape[0]):
                attention_kernels.dequant_q8(self.k[b], self.k_scale[b], ko[b])
                attention_kernels.dequant_q8(self.v[b], self.v_scale[b], vo[b])
        else:
            dequantize_q8_0(self.k[:, :, :end], self.k_scale[:, :, :end], dtype, out=ko)
            dequantize_q8_0(self.v[:, :, :end], self.v_scale[:, :, :end], dtype, out=vo)
        return ko, vo

    def kernel_args(self, b: int = 0) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(k, v, k_scale, v_scale) of batch row b as the kernels take them: [nkv, S, hd] (and [nkv, S, hd/32])."""
        ks = None if self.k_scale is None else self.k_scale[b]
        vs = None if self.v_scale is None else self.v_scale[b]
        return self.k[b], self.v[b], ks, vs


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 quant: str | None = None, spare: int = 0) -> None:
        """`dtype` is the compute dtype (what reads return); `quant` = "q8_0" stores 8-bit blocks instead.
        `spare`: slots past `capacity` that hold no position (runtime/target_compiled.py writes a window's padding
        rows there and reads whole chunks); the capacity is what positions may use."""
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}.")
        if quant is not None and quant not in KV_QUANTS:
            raise ValueError(f"unknown KV cache format {quant!r}; use one of {', '.join(KV_QUANTS)}.")
        if quant == "q8_0" and head_dim % Q8_BLOCK:
            raise ValueError(f"a q8_0 KV cache needs a head_dim that is a multiple of {Q8_BLOCK}, "
                             f"not {head_dim}; use a 16-bit kv_dtype for this model.")
        shape = (n_layers, batch, n_kv_heads, capacity + max(0, int(spare)), head_dim)
        store = torch.int8 if quant else dtype
        self.k: Tensor = torch.zeros(shape, dtype=store, device=device)
        self.v: Tensor = torch.zeros(shape, dtype=store, device=device)
        self.k_scale: Tensor | None = None
        self.v_scale: Tensor | None = None
        if quant:
            sshape = shape[:-1] + (head_dim // Q8_BLOCK,)
            self.k_scale = torch.zeros(sshape, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(sshape, dtype=torch.float16, device=device)
        self.quant, self.dtype = quant, dtype
        self.capacity, self.batch, self.length = capacity, batch, 0
        self._scratch: tuple[Tensor, Tensor] | None = None

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self, i)

    def rollback(self, length: int) -> None:
        """Forget everything at or after `length` (a committed length, never longer than what was written)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} positions.")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        """The cache itself (values and scales; not the prefill scratch)."""
        ts = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quant else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def dequant_scratch(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Two [B, nkv, S, hd] buffers in `dtype` that a quantized cache dequantizes one layer's prefix into for
        the prefill's attention (allocated once, at the first prefill; docs/budget.md `scratch`)."""
        if self._scratch is None or self._scratch[0].dtype != dtype:
            shape = self.k.shape[1:]
            self._scratch = (torch.empty(shape, dtype=dtype, device=self.k.device),
                             torch.empty(shape, dtype=dtype, device=self.k.device))
        return self._scratch

    @property
    def scratch_nbytes(self) -> int:
        return 0 if self._scratch is None else sum(t.numel() * t.element_size() for t in self._scratch)

    def committed(self) -> tuple[Tensor, Tensor]:
        """The valid rows [L, B, nkv, length, hd] (tests compare these); a quantized cache returns them
        dequantized to its compute dtype."""
        n = self.length
        if self.quant is None:
            return self.k[:, :, :, :n], self.v[:, :, :, :n]
        return (dequantize_q8_0(self.k[:, :, :, :n], self.k_scale[:, :, :, :n], self.dtype),
                dequantize_q8_0(self.v[:, :, :, :n], self.v_scale[:, :, :, :n], self.dtype))
