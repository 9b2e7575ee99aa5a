"""CPU weight layout: float linear weights held input-major ([in, out] in memory, the module's [out, in] weight a
transposed view of it), so F.linear's product reaches BLAS as a plain x @ W (docs/models.md, "Numerics", CPU).

Why: a CPU step on a small model is paid per op and per cache miss, and BLAS multiplies a few rows by a row-major
[in, out] matrix faster than by the transpose of an [out, in] one: on a 2-core Xeon VM, 1 thread, fp32, the
4096 x 256 vocabulary head costs 350 -> 199 us for 4 rows, a 256 -> 1024 product 18 -> 10 us for one row. Same
values and same shapes, so the fixed-width step's row invariance is untouched (each width keeps one kernel).
"""

from __future__ import annotations

from torch import Tensor, nn

from runtime.models.layers import Attention, SparseMoe


def input_major(w: Tensor) -> Tensor:
    """The same values as w [out, in], stored as [in, out]; the result is the transposed view (shape [out, in])."""
    return w.detach().t().contiguous().t()


def _is_input_major(w: Tensor) -> bool:
    return w.dim() == 2 and w.stride() == (1, w.shape[0])


def relayout(model: nn.Module) -> int:
    """Hold every float nn.Linear weight of `model` (target, MTP head) input-major, keeping stacked matrices and
    the views into them shared (q/k/v in `qkv_weight`, a small layer's experts in `dense_gu`/`dense_down`); a
    weight that another module also uses (tied embeddings) stays as it is. Returns the matrices moved."""
    moved = 0
    for mod in model.modules():
        if isinstance(mod, Attention) and mod.qkv_weight is not None and not _is_input_major(mod.qkv_weight):
            cat = input_major(mod.qkv_weight)
            o = 0
            for p in (mod.q_proj, mod.k_proj, mod.v_proj):
                n = p.weight.shape[0]
                p.weight.data = cat[o:o + n]
                o += n
            mod.qkv_weight = cat
            moved += 1
        if isinstance(mod, SparseMoe) and mod.dense_gu is not None and not _is_input_major(mod.dense_gu):
            mod.dense_gu, mod.dense_down = input_major(mod.dense_gu), input_major(mod.dense_down)
            inter = mod.inter
            for e, ex in enumerate(mod.experts):
                ex.gate_proj.weight.data = mod.dense_gu[2 * inter * e:2 * inter * e + inter]
                ex.up_proj.weight.data = mod.dense_gu[2 * inter * e + inter:2 * inter * (e + 1)]
                ex.down_proj.weight.data = mod.dense_down[:, inter * e:inter * (e + 1)]
            moved += 2
    users: dict[int, int] = {}       # storage -> how many weights (linear or embedding) live in it
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            key = mod.weight.untyped_storage().data_ptr()
            users[key] = users.get(key, 0) + 1
    for mod in model.modules():
        if not isinstance(mod, nn.Linear):
            continue
        w = mod.weight
        if (w.device.type != "cpu" or not w.dtype.is_floating_point or not w.is_contiguous()
                or users[w.untyped_storage().data_ptr()] > 1 or _is_input_major(w)):
            continue
        mod.weight.data = input_major(w)
        moved += 1
    return moved
