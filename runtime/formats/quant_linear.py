"""A linear layer whose weight stays in ggml blocks (docs/formats.md, "Block formats"): never a float copy kept."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.errors import QuantFormatError
from runtime.formats.blocks import dequantize_torch, quantize
from runtime.formats.registry import block_format, row_bytes


class QuantLinear(nn.Module):
    """A linear layer whose weight lives as ggml blocks in a uint8 buffer; dequantized on the fly per call."""

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.qtype = block_format(qtype).name
        self.in_features = in_features
        self.out_features = out_features
        rb = row_bytes(in_features, self.qtype)
        self.register_buffer("blocks", torch.zeros(out_features, rb, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor | np.ndarray, qtype: str, in_features: int) -> QuantLinear:
        """Wrap existing blocks [out, row_bytes] (e.g. read from a GGUF file) without a float copy."""
        t = torch.as_tensor(np.ascontiguousarray(blocks)) if isinstance(blocks, np.ndarray) else blocks
        mod = cls(in_features, t.shape[0], qtype, device="meta")
        if tuple(t.shape) != (t.shape[0], row_bytes(in_features, qtype)):
            raise QuantFormatError(f"blocks shape {tuple(t.shape)} does not hold rows of {in_features} {qtype} values")
        mod.blocks = t.to(torch.uint8)
        return mod

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: str) -> QuantLinear:
        """Quantize a float weight [out, in] (through `quantize`, so the bytes match gguf-py)."""
        w = weight.detach().to(torch.float32).cpu().numpy()
        return cls.from_blocks(quantize(w, qtype), qtype, w.shape[1]).to(weight.device)

    @property
    def weight_nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_torch(self.blocks, self.qtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.qtype != "bf16":
            from runtime.gpu import dense_kernels, kernels, moe_kernels

            # one row dequantized in registers (no float copy of the matrix); more rows through one shared scratch
            if kernels.available(x) and self.qtype in moe_kernels.QCODE:
                y = dense_kernels.quant_linear(x, self.blocks, self.qtype, self.in_features)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


class QuantEmbedding(nn.Module):
    """An embedding table kept as ggml blocks (one row per token): a lookup dequantizes only the rows it reads.

    A quantized GGUF target stores `token_embd` in its block format; with tied embeddings the output head is a
    `QuantLinear` over the same blocks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.qtype = block_format(qtype).name
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("blocks", torch.zeros(num_embeddings, row_bytes(embedding_dim, self.qtype),
                                                   dtype=torch.uint8, device=device))

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: str, embedding_dim: int,
                    dtype: torch.dtype = torch.float32) -> QuantEmbedding:
        mod = cls(blocks.shape[0], embedding_dim, qtype, dtype, device="meta")
        if tuple(blocks.shape) != (blocks.shape[0], row_bytes(embedding_dim, mod.qtype)):
            raise QuantFormatError(f"blocks shape {tuple(blocks.shape)} does not hold rows of {embedding_dim} "
                                   f"{qtype} values")
        mod.blocks = blocks.to(torch.uint8)
        return mod

    @property
    def weight_nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1).to(self.blocks.device))
        return dequantize_torch(rows, self.qtype).to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"
