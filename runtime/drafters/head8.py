"""The MTP chain's vocabulary head in 8 bits on a CPU (runtime/drafters/mtp.py): int8 rows with one bf16 scale
each, multiplied by the C++ int8 head where it is loaded (runtime/cpu_ops.py) or torch's weight-only int8 kernel
(docs/models.md, "MTP head").

Why: on a CPU the chain's vocabulary product streams the head once a step (4 MB in fp32 on the bundled pack, past
a core's L2); 8 bits read a quarter of that. A draft needs no particular bits: verification decides, so the output
is unchanged; only how often a draft is accepted could move. The budget counts it (setup_wizard/budget.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime import cpu_ops

# False: the chain uses the target's own head on a CPU too
CPU_INT8_HEAD = True
# False: torch's weight-only int8 kernel even where the C++ int8 head is loaded (bench/drafters.py compares them)
USE_OP = True


def op_fits(hidden: int) -> bool:
    """Whether the C++ int8 head (runtime/cpu_ops.py) serves a head of input width `hidden` in this process."""
    return USE_OP and cpu_ops.registered() and hidden % 64 == 0


def usable(hidden: int) -> bool:
    """Whether the int8 head is used for a head of input width `hidden` (torch's CPU kernel reads the input in
    whole vectors: it crashes on a width of 30)."""
    return CPU_INT8_HEAD and hasattr(torch, "_weight_int8pack_mm") and hidden % 16 == 0


def nbytes(vocab: int, hidden: int) -> int:
    """What the int8 head holds: a byte per weight and a bf16 scale per row (0 when it is not used)."""
    return vocab * hidden + 2 * vocab if usable(hidden) else 0


def dense_nbytes(hidden: int, q_width: int, kv_width: int, experts: int = 0, inter: int = 0) -> int:
    """What the compiled chain's int8 copies of the head's layer matrices hold (runtime/drafters/mtp_compiled.py:
    fc [H, 2H], q/k/v [q + 2 kv, H], o_proj [H, q], and with `experts` of width `inter` their gate/up [E * 2I, H]
    and down [E * H, I]): a byte per weight and an fp32 scale per row, where the widths fit the C++ products
    (multiples of 64, the experts' of 32; 0 elsewhere). The budget counts it where the chain's step is compiled: a
    machine that then cannot build the ops holds less than its budget says, never more."""
    if not usable(hidden) or any(k % 64 for k in (hidden, q_width)):
        return 0
    rows = hidden + q_width + 2 * kv_width + hidden
    total = 2 * hidden * hidden + (q_width + 2 * kv_width) * hidden + hidden * q_width + 4 * rows
    if experts and inter % 32 == 0:
        total += experts * (3 * hidden * inter + 4 * (2 * inter + hidden))
    return total


def quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of w [N, K] as int8 and one bf16 scale each (the scale as the kernels read it, rounded up so that
    no weight leaves [-127, 127]: every weight is then within half a step of its int8 value)."""
    w = w.detach().float()
    scale = ((w.abs().amax(1) / 127).clamp(min=1e-30) * (1 + 2 ** -8)).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def int8_head(head) -> tuple[Tensor, Tensor] | None:
    """The head's weight [V, H] as int8 rows and their bf16 scales, for `logits`; None for a head that is not a
    float nn.Linear without bias (a block-format GGUF head stays as it is) or when `usable` says no."""
    w = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or w is None or not w.dtype.is_floating_point \
            or not usable(w.shape[1]):
        return None
    return quantize(w)


def logits(h: Tensor, head: tuple[Tensor, Tensor], cast: bool = True) -> Tensor:
    """h [n, H] -> logits [n, V]: through the C++ int8 head (runtime/cpu_ops.py: h in int16, integer products)
    where this process has it loaded, as the compiled chain's package does, else torch's weight-only kernel (the
    product in bf16 activations), in fp32 unless `cast` is False (then bf16 from torch's kernel: for a caller that
    copies them into an fp32 buffer anyway)."""
    if h.device.type == "cpu" and op_fits(h.shape[-1]):
        return torch.ops.strata.int8_head(h.float().contiguous(), *head)
    out = torch._weight_int8pack_mm(h.to(torch.bfloat16), *head)
    return out.float() if cast else out
