"""A prefill chunk through the decode step's fused kernels and flash attention (docs/models.md, "Prefill").

Why: the module forward (runtime/models/qwen3_moe.py) spends a third of an 8k-token prefill of the A3B shape on
element-wise passes over [T, heads, 128] tensors: RMSNorm in four ops, q/k-norm, RoPE as five ops and a
concatenation, the cache write, the transposes (H200: 69 of 220 ms in kernels that are not products,
bench/step_profile.py --prefill). The fused step's kernels do each of those in one pass and work at any row
count: RMSNorm with the residual add folded in (runtime/gpu/dense_kernels.py), q/k-norm + RoPE + the K/V write in
one launch (`attention_kernels.qkv_post`). Attention stays SDPA's flash kernel over the cache (the lower-right
causal mask: a chunk's row i sees the prefix and rows 0..i), the experts the grouped prefill kernels
(`SparseMoe.forward`). Same semantics as the module forward, rounded where it rounds; the bits may differ from it
in the last place (one stacked q/k/v product instead of three), which nothing compares bit for bit: a prompt is
prefilled the same way with and without a drafter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.gpu import attention_kernels, dense_kernels, kernels
from runtime.gpu.fallback import fell_back
from runtime.kv import KVCache
from runtime.models.layers import cached_attention
from runtime.models.qwen3_moe import Qwen3MoeModel, TargetOutput

ENABLED = True
ERRORS: list[str] = []          # why the fused path was given up (a kernel that did not build), for the benchmarks


def usable(model, kv: KVCache) -> bool:
    """Whether `forward` can run this model on this cache: a CUDA cache of the model's dtype with Triton, batch 1,
    no attention bias, q/k/v stacked into one product (stacked here when they can be)."""
    if not isinstance(model, Qwen3MoeModel):
        return False
    cfg = model.cfg
    p = model.model.norm.weight
    if not (ENABLED and not ERRORS and kv.k.is_cuda and kernels.available(kv.k) and kv.batch == 1
            and kv.dtype == p.dtype and not cfg.attention_bias and cfg.head_dim % 2 == 0):
        return False
    for layer in model.model.layers:
        a = layer.self_attn
        if not a.has_qkv:
            a.stack_qkv()
        if not a.has_qkv:
            return False
    return True


@torch.no_grad()
def forward(model, kv: KVCache, input_ids: Tensor, taps: tuple[int, ...] = (), logits_to_keep: int = 0
            ) -> TargetOutput:
    """The contract of `model(input_ids, kv=kv, taps=taps, logits_to_keep=...)` for input_ids [1, T] appended at
    kv.length (call `usable` first)."""
    m = model
    cfg = m.cfg
    eps = cfg.rms_norm_eps
    T = int(input_ids.shape[1])
    start = kv.length
    if start + T > kv.capacity:
        raise ValueError(f"{start + T} positions exceed the KV cache capacity {kv.capacity}; raise the context.")
    dev = kv.k.device
    pos = torch.arange(start, start + T, dtype=torch.int32, device=dev)
    inv, rscale = m.rotary.inv_freq.to(dev), m.rotary.scale
    x = m.model.embed_tokens(input_ids.to(dev))[0]                       # [T, H]
    wanted = {t: j for j, t in enumerate(taps)}
    tap_out: list[Tensor | None] = [None] * len(taps)
    y: Tensor | None = None                                             # the last layer's MLP output, not yet added
    layers = m.model.layers
    for i, layer in enumerate(layers):
        a = layer.self_attn
        lkv = kv.layer(i)
        kc, vc, ks, vs = lkv.kernel_args()
        x, h = dense_kernels.rmsnorm(x, layer.input_layernorm.weight, eps, delta=y)
        if i - 1 in wanted:
            tap_out[wanted[i - 1]] = x
        q = attention_kernels.qkv_post(a.qkv(h), a.q_norm.weight, a.k_norm.weight, inv, rscale, pos, kc, vc, a.nh,
                                       a.nkv, a.hd, eps, ks=ks, vs=vs)
        keys, vals = lkv.read(start + T, q.dtype)                        # [1, nkv, S, hd] (a view in BF16)
        o = cached_attention(q.transpose(0, 1)[None], keys, vals, a.scale)    # [1, nh, T, hd]
        d = a.o_proj(o[0].transpose(0, 1).reshape(T, a.nh * a.hd))
        x, h = dense_kernels.rmsnorm(x, layer.post_attention_layernorm.weight, eps, delta=d)
        y = layer.mlp(h)
    x, hidden = dense_kernels.rmsnorm(x, m.model.norm.weight, eps, delta=y)
    if len(layers) - 1 in wanted:
        tap_out[wanted[len(layers) - 1]] = x
    kv.length = start + T
    logits = None
    if logits_to_keep >= 0:
        hk = hidden if logits_to_keep == 0 else hidden[-logits_to_keep:]
        logits = m.lm_head(hk)[None]
    tap_t = torch.cat(tap_out, dim=-1)[None] if taps else None  # type: ignore[arg-type]
    return TargetOutput(logits=logits, hidden=hidden[None], taps=tap_t)


def run(model, kv: KVCache, input_ids: Tensor, taps: tuple[int, ...], logits_to_keep: int) -> TargetOutput:
    """The fused chunk where it can run, else (or after a kernel that fails, remembered in ERRORS) the module
    forward."""
    if usable(model, kv):
        start = kv.length
        try:
            return forward(model, kv, input_ids, taps, logits_to_keep)
        except (torch.cuda.OutOfMemoryError, ValueError):      # the request's own problem: the module forward's too
            kv.length = start
            raise
        except Exception as e:  # a kernel that does not build here: the module forward rewrites the same slots
            fell_back(ERRORS, e, "the fused prefill chunk", "the module forward")
            kv.length = start
    return model(input_ids, kv=kv, taps=taps, logits_to_keep=logits_to_keep)
