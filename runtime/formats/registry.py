"""The one table of block formats (docs/formats.md, "Block formats"), without torch.

Budget, converter, loaders, kernels, CLI help and wizard labels all read `FORMATS`; ids and block sizes come from
gguf-py's constants, never written out by hand. Quantizing and dequantizing live in runtime/formats/blocks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from runtime.errors import QuantFormatError

__all__ = ["BLOCK", "FORMATS", "QTYPES", "BlockFormat", "block_format", "by_tensor_type", "cols_from_row_bytes",
           "row_bytes", "writable_format"]


@dataclass(frozen=True)
class BlockFormat:
    """One storage format of a weight matrix."""

    name: str              # what flags, configs and manifests say: "q4_0"
    ggml: GGMLQuantizationType
    file: LlamaFileType    # general.file_type of a file whose matrices are mostly in this format
    label: str             # one line for help texts and the wizard
    offered: bool = True   # the wizard lists it (the others are chosen by flag)
    writable: bool = True  # Strata quantizes to it; False: read from others' files only (K-quants)

    @property
    def ggml_type(self) -> int:
        return int(self.ggml)

    @property
    def file_type(self) -> int:
        return int(self.file)

    @property
    def tensor_type(self) -> str:
        """The name GGUF readers give a tensor of this type ("Q4_0")."""
        return self.ggml.name

    @property
    def block_values(self) -> int:
        return GGML_QUANT_SIZES[self.ggml][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.ggml][1]

    @property
    def quantized(self) -> bool:
        return self.ggml != GGMLQuantizationType.BF16

    def nbytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] matrix in this format."""
        return rows * row_bytes(cols, self.name)


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("bf16", GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16, "BF16 — original weights, most accurate"),
    BlockFormat("q8_0", GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0,
                "Q8_0 — about half the memory, near-identical drafts"),
    BlockFormat("q5_0", GGMLQuantizationType.Q5_0, LlamaFileType.MOSTLY_Q5_0, "Q5_0 — between Q8_0 and Q4_0",
                offered=False),
    BlockFormat("q4_0", GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0,
                "Q4_0 — about a quarter of the memory, leaves the most room for experts"),
    # read only: the K-quants of llama.cpp's files (a Q4_K_M file mixes Q4_K and Q6_K tensors, a Q5_K_M file Q5_K
    # and Q6_K, a Q4_K_S file Q4_K and Q5_K; Q3_K_* and Q2_K files Q3_K or Q2_K with some of the others)
    BlockFormat("q6_k", GGMLQuantizationType.Q6_K, LlamaFileType.MOSTLY_Q6_K, "Q6_K — read from llama.cpp files",
                offered=False, writable=False),
    BlockFormat("q4_k", GGMLQuantizationType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M,
                "Q4_K — read from llama.cpp files (Q4_K_M mixes it with Q6_K)", offered=False, writable=False),
    BlockFormat("q5_k", GGMLQuantizationType.Q5_K, LlamaFileType.MOSTLY_Q5_K_M,
                "Q5_K — read from llama.cpp files (Q5_K_M mixes it with Q6_K)", offered=False, writable=False),
    BlockFormat("q3_k", GGMLQuantizationType.Q3_K, LlamaFileType.MOSTLY_Q3_K_M,
                "Q3_K — read from llama.cpp files (Q3_K_M mixes it with Q4_K, Q5_K and Q6_K)", offered=False,
                writable=False),
    BlockFormat("q2_k", GGMLQuantizationType.Q2_K, LlamaFileType.MOSTLY_Q2_K,
                "Q2_K — read from llama.cpp files (mixed with Q3_K, Q4_K and Q6_K)", offered=False, writable=False),
    # read only: llama.cpp's non-linear 4-bit formats (an IQ4_XS file mixes IQ4_XS with some K-quant tensors)
    BlockFormat("iq4_xs", GGMLQuantizationType.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS,
                "IQ4_XS — read from llama.cpp files", offered=False, writable=False),
    BlockFormat("iq4_nl", GGMLQuantizationType.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL,
                "IQ4_NL — read from llama.cpp files", offered=False, writable=False),
)}
QTYPES: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if f.writable)   # what Strata writes
BLOCK = 32


def block_format(name: str) -> BlockFormat:
    """The format called `name` (case-insensitive), or one sentence naming the choices."""
    f = FORMATS.get(str(name).lower())
    if f is None:
        raise QuantFormatError(f"unknown quantization {name!r}; use one of {', '.join(QTYPES)}.")
    return f


def writable_format(name: str) -> BlockFormat:
    """`block_format`, refusing the read-only formats (one sentence naming the ones Strata writes)."""
    f = block_format(name)
    if not f.writable:
        raise QuantFormatError(f"{f.name} is read only (a format of llama.cpp's files): Strata reads it but does not "
                               f"write it; use one of {', '.join(QTYPES)}.")
    return f


def by_tensor_type(tensor_type: str) -> BlockFormat | None:
    """The format of a GGUF tensor type name ("Q4_0"), None when it is not in the table (F32, IQ-quants, ...)."""
    return next((f for f in FORMATS.values() if f.tensor_type == str(tensor_type).upper()), None)


def _check_qtype(qtype: str) -> str:
    """A format runtime/formats/blocks.py dequantizes (every row of the table: the K-quants through
    runtime/formats/kquants.py, IQ4_NL and IQ4_XS through runtime/formats/iquants.py); quantizing asks
    `writable_format`."""
    return block_format(qtype).name


def row_bytes(cols: int, qtype: str) -> int:
    """Bytes one row of `cols` values takes in `qtype`."""
    f = block_format(qtype)
    if cols % f.block_values:
        raise QuantFormatError(f"row length {cols} is not a multiple of {f.block_values}, so it cannot be stored "
                               f"as {f.name}")
    return cols // f.block_values * f.block_bytes


def cols_from_row_bytes(nbytes: int, qtype: str) -> int:
    """Inverse of `row_bytes`."""
    f = block_format(qtype)
    if nbytes % f.block_bytes:
        raise QuantFormatError(f"{nbytes} bytes per row is not a whole number of {f.name} blocks")
    return nbytes // f.block_bytes * f.block_values
