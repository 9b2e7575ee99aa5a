"""Long context on the Qwen3-30B-A3B shape: decode at 1k..128k tokens of context (window W = 1 and 8) and prefill of
2k..32k-token prompts, with the KV cache in BF16 and in q8_0, next to transformers (sdpa) on the same weights and
next to the hardware bounds.

    python bench/context.py --check     # correctness only (first GPU call): exit 1 when a check fails
    python bench/context.py [--quick]   # timing: prints tables, writes bench/results/context.json ($OUT if set)

Target: random BF16 weights of the A3B shape built on the GPU (bench/common.py), with honest routing (embeddings at
std 1, attention output and expert down projections scaled by 0.05, so a window's rows pick independent experts;
the distinct experts per layer of a window are measured and reported). Decode rows do not run a long prefill: the
KV cache is filled with random values of the right scale (K ~ N(0, 1) as after k_norm, V ~ N(0, 0.9^2) as v_proj
gives) and the engine's fixed-width CUDA-graph step runs at that length. For W = 8, `tok_s` is steps per second (one
committed token per step, as in target-only decoding through an 8-wide step) and `window_tok_s` = 8 x that.

Bounds (same run): decode = measured device-to-device copy bandwidth (read + write) / bytes one step must read
(dense weights without the embedding table, the distinct experts of the window, one embedding row per row, the KV
cache up to the context); prefill = measured BF16 matmul rate / FLOPs per prompt token (2 x active matmul weights +
causal attention 4 x layers x heads x head_dim x (n + 1) / 2).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:       # before any kernel module is imported: @triton.jit then builds interpreted kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    NANO,
    Deadline,
    copy_bandwidth,
    machine,
    matmul_peak,
    median,
    print_table,
    task_prompts,
    write_json,
)
from runtime.gpu import moe_split  # noqa: E402
from runtime.kv import (  # noqa: E402
    KV_TIERS,
    ONE_ROW_CHUNKS,
    ONE_ROW_CHUNKS_Q8,
    KVCache,
    partial_chunks,
    quantize_q8_0,
)
from runtime.models.layers import SparseMoe  # noqa: E402

KV_KINDS = ("bf16", "q8_0")
DEV, DT = "cuda", torch.bfloat16   # `--smoke`: every code path on the CPU (fp32, Triton interpreter), tiny model
CHECK_CONTEXTS = (300, 5000, 40000)
SMOKE_CFG = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16,
             "num_experts_per_tok": 4, "moe_intermediate_size": 32}
DEFAULT = dict(contexts=(1024, 4096, 16384, 32768, 131072), widths=(1, 8), prefill=(2048, 8192, 32768),
               hf_decode=(1024, 4096, 32768), hf_prefill=(2048, 8192), steps=20)
QUICK = dict(contexts=(4096, 32768), widths=(1, 8), prefill=(8192,), hf_decode=(), hf_prefill=(), steps=10)
SMOKE = dict(contexts=(300,), widths=(1, 2), prefill=(256,), hf_decode=(300,), hf_prefill=(256,), steps=1)


# ----------------------------------------------------------------------------------------------------- the target
def build_a3b(seed: int = 0):
    """The A3B-shaped random target with honest routing (bench/common.py), and its config dict."""
    from bench.common import A3B_SHAPE, build_random_a3b

    cfg = A3B_SHAPE if DEV == "cuda" else {**A3B_SHAPE, **SMOKE_CFG}
    model, _ = build_random_a3b(cfg, device=DEV, seed=seed, dtype=DT)
    return model, cfg


def experts_per_window(model, widths=(1, 8, 16), n: int = 64) -> dict[int, float]:
    """Mean distinct experts per MoE layer in windows of W consecutive tokens of a random prompt."""
    from bench.common import distinct_experts

    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    return {w: distinct_experts(model, ids, w)["mean"] for w in widths}


def make_kv(model, ctx: int, kv_kind: str, capacity: int | None = None, seed: int = 0) -> KVCache:
    """A cache of `capacity` positions whose first `ctx` hold random K ~ N(0, 1), V ~ N(0, 0.9^2)."""
    c = model.cfg
    quant = None if kv_kind == "bf16" else kv_kind
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity or ctx + 64, dtype=DT,
                 device=DEV, quant=quant)
    g = gen(seed)
    for i in range(c.num_hidden_layers):
        for t, s, std in ((kv.k, kv.k_scale, 1.0), (kv.v, kv.v_scale, 0.9)):
            x = torch.empty(1, c.num_key_value_heads, ctx, c.head_dim, device=DEV, dtype=DT)
            x.normal_(0, std, generator=g)
            if quant:
                t[i, :, :, :ctx], s[i, :, :, :ctx] = quantize_q8_0(x)
            else:
                t[i, :, :, :ctx] = x
    kv.length = ctx
    return kv


def kv_bytes_per_position(model, kv_kind: str) -> int:
    c = model.cfg
    row = c.head_dim * 2 if kv_kind == "bf16" else c.head_dim + 2 * (c.head_dim // 32)
    return c.num_hidden_layers * 2 * c.num_key_value_heads * row


def weight_bytes(model) -> tuple[int, int, int]:
    """(dense bytes without the embedding table, bytes of one routed expert, MoE layers)."""
    dense = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or ".mlp.experts." in name or name == "model.embed_tokens.weight":
            continue
        dense += p.numel() * p.element_size()
    c = model.cfg
    el = model.lm_head.weight.element_size()
    n_moe = sum(isinstance(layer.mlp, SparseMoe) for layer in model.model.layers)
    return dense, 3 * c.hidden_size * c.moe_intermediate_size * el, n_moe


def prefill_flops_per_token(model, n: int) -> float:
    """2 x the matmul weights a prompt token uses (q/k/v/o, router, top-k experts; no embedding, no lm_head: the
    prefill keeps the last row's logits only) + causal attention over (n + 1) / 2 positions on average."""
    c = model.cfg
    H, hd = c.hidden_size, c.head_dim
    attn_w = H * (c.num_attention_heads + 2 * c.num_key_value_heads) * hd + c.num_attention_heads * hd * H
    moe_w = H * c.num_experts + c.num_experts_per_tok * 3 * H * c.moe_intermediate_size
    per_layer = 2 * (attn_w + moe_w) + 4 * c.num_attention_heads * hd * (n + 1) / 2
    return c.num_hidden_layers * per_layer


def free_cuda() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(DEV).manual_seed(seed)


class Timer:
    """Seconds between start() and stop(): CUDA events on the GPU, the wall clock elsewhere."""

    def start(self) -> None:
        if DEV == "cuda":
            self.e0, self.e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.e0.record()
        self.t = time.perf_counter()

    def stop(self) -> float:
        if DEV == "cuda":
            self.e1.record()
            self.e1.synchronize()
            return self.e0.elapsed_time(self.e1) / 1e3
        return time.perf_counter() - self.t


# ----------------------------------------------------------------------------------------------------- decode
def time_decode(model, kv: KVCache, width: int, steps: int) -> dict[str, Any]:
    """Steps of the engine's fixed-width graph step at the cache's length (rolled back after each step)."""
    from runtime.gpu.static_step import StaticStep

    ctx = kv.length
    step = StaticStep(model, kv, width, graph=True)
    win = torch.randint(0, model.cfg.vocab_size, (1, width), device=DEV,
                        generator=gen(ctx + width))
    for _ in range(2 if DEV == "cuda" else 1):     # capture, warm
        step(win, kv)
        kv.rollback(ctx)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step(win, kv)
        kv.rollback(ctx)
    sync()
    dt = (time.perf_counter() - t) / steps
    out = {"step_ms": dt * 1e3, "graph": step.use_graph, "kernels": step.use_kernels, "fused": step.fused,
           "errors": list(step.errors)}
    del step
    return out


def decode_rows(model, args, bw: float, dist: dict[int, float], deadline: Deadline) -> list[dict[str, Any]]:
    dense, expert, n_moe = weight_bytes(model)
    H = model.cfg.hidden_size
    rows = []
    for kv_kind in args.kv:
        for ctx in args.contexts:
            if deadline.over():
                print(f"  (time budget spent: decode rows from {kv_kind} {ctx} on skipped)", flush=True)
                return rows
            kv = make_kv(model, ctx, kv_kind, capacity=max(args.capacity, ctx + 64))
            for w in args.widths:
                r = time_decode(model, kv, w, args.steps)
                experts = dist.get(w, model.cfg.num_experts_per_tok)
                kv_read = kv_bytes_per_position(model, kv_kind) * ctx
                step_bytes = dense + n_moe * experts * expert + w * H * 2 + kv_read
                bound = bw / step_bytes
                tok_s = 1e3 / r["step_ms"]
                rows.append(dict(kind="decode", impl="strata", kv_dtype=kv_kind, context=ctx, width=w, tok_s=tok_s,
                                 window_tok_s=w * tok_s, bound_tok_s=bound, frac_of_bound=tok_s / bound,
                                 step_bytes=step_bytes, kv_bytes=kv_read, distinct_experts=experts,
                                 capacity=kv.capacity, **r))
                print(f"  decode {kv_kind:5s} ctx {ctx:>6} W={w}: {r['step_ms']:.2f} ms/step, {tok_s:.0f} tok/s, "
                      f"{100 * tok_s / bound:.0f}% of bound ({bound:.0f}){' ERR ' + str(r['errors']) if r['errors'] else ''}",
                      flush=True)
            del kv
            free_cuda()
    return rows


# ----------------------------------------------------------------------------------------------------- prefill
def time_prefill(model, n: int, kv_kind: str, chunk: int) -> float:
    from runtime.speculative import prefill

    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n + 8, dtype=DT, device=DEV,
                 quant=None if kv_kind == "bf16" else kv_kind)
    ids = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    with torch.no_grad():
        prefill(model, kv, ids[: min(n, chunk)], (), chunk)          # warm (kernels compiled, buffers made)
        kv.reset()
        sync()
        t = time.perf_counter()
        prefill(model, kv, ids, (), chunk)
        sync()
        dt = time.perf_counter() - t
    del kv
    free_cuda()
    return n / dt


def prefill_rows(model, args, peak: float, deadline: Deadline) -> list[dict[str, Any]]:
    from runtime.memory import default_prefill_chunk

    rows = []
    chunks = [args.prefill_chunk or default_prefill_chunk("cuda")] + [int(x) for x in args.extra_chunks]
    for kv_kind in args.kv:   # q8_0: the middle prompt length only (its prefill differs by the dequantization)
        for n in args.prefill if kv_kind == "bf16" else [sorted(args.prefill)[len(args.prefill) // 2]]:
            for ch in chunks if kv_kind == "bf16" else chunks[:1]:
                if deadline.over():
                    print("  (time budget spent: prefill rows skipped)", flush=True)
                    return rows
                tok_s = time_prefill(model, n, kv_kind, ch)
                bound = peak / prefill_flops_per_token(model, n)
                rows.append(dict(kind="prefill", impl="strata", kv_dtype=kv_kind, context=n, width=ch, chunk=ch,
                                 tok_s=tok_s, bound_tok_s=bound, frac_of_bound=tok_s / bound,
                                 tflops=tok_s * prefill_flops_per_token(model, n) / 1e12))
                print(f"  prefill {kv_kind:5s} n {n:>6} chunk {ch}: {tok_s:,.0f} tok/s, {100 * tok_s / bound:.1f}% of "
                      f"bound ({bound:,.0f})", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------- transformers
def hf_rows(model, cfg_json, args, bw: float, peak: float, dist, deadline: Deadline) -> list[dict[str, Any]]:
    """transformers (sdpa, its default experts implementation) on the same device tensors: prefill of a prompt in
    one forward, decode after a DynamicCache filled with random K/V of the same scale."""
    from transformers import DynamicCache

    from bench.decode import hf_twin

    rows: list[dict[str, Any]] = []
    if not args.hf_decode and not args.hf_prefill:
        return rows
    hf = hf_twin(model, cfg_json)
    c = model.cfg
    impl = getattr(hf.config, "_experts_implementation", None)
    dense, expert, n_moe = weight_bytes(model)
    with torch.no_grad():
        for n in args.hf_prefill:
            if deadline.over():
                break
            ids = torch.randint(0, c.vocab_size, (1, n), device=DEV)
            hf(ids[:, :256], use_cache=False, logits_to_keep=1)
            sync()
            t = time.perf_counter()
            hf(ids, use_cache=False, logits_to_keep=1)
            sync()
            tok_s = n / (time.perf_counter() - t)
            bound = peak / prefill_flops_per_token(model, n)
            rows.append(dict(kind="prefill", impl="transformers", kv_dtype="bf16", context=n, width=n, tok_s=tok_s,
                             bound_tok_s=bound, frac_of_bound=tok_s / bound, experts_implementation=impl))
            print(f"  transformers prefill n {n}: {tok_s:,.0f} tok/s", flush=True)
            free_cuda()
        for ctx in args.hf_decode:
            if deadline.over():
                break
            g = gen(ctx)
            cache = DynamicCache()
            for i in range(c.num_hidden_layers):
                k = torch.empty(1, c.num_key_value_heads, ctx, c.head_dim, device=DEV, dtype=DT)
                v = torch.empty_like(k)
                cache.update(k.normal_(0, 1.0, generator=g), v.normal_(0, 0.9, generator=g), i)
            tok = torch.randint(0, c.vocab_size, (1, 1), device=DEV)
            n_tok = 8
            times = []
            for j in range(n_tok + 1):
                sync()
                t = time.perf_counter()
                out = hf(tok, past_key_values=cache, use_cache=True, logits_to_keep=1,
                         position_ids=torch.tensor([[ctx + j]], device=DEV))
                tok = out.logits[:, -1:].argmax(-1)
                sync()
                times.append(time.perf_counter() - t)
            tok_s = 1 / median(times[1:])
            step_bytes = dense + n_moe * c.num_experts_per_tok * expert + kv_bytes_per_position(model, "bf16") * ctx
            bound = bw / step_bytes
            rows.append(dict(kind="decode", impl="transformers", kv_dtype="bf16", context=ctx, width=1, tok_s=tok_s,
                             bound_tok_s=bound, frac_of_bound=tok_s / bound, experts_implementation=impl))
            print(f"  transformers decode ctx {ctx}: {tok_s:.1f} tok/s", flush=True)
            del cache
            free_cuda()
    del hf
    free_cuda()
    return rows


# ----------------------------------------------------------------------------------------------------- attention alone
def attention_rows(model, bw: float, contexts=(32768, 131072), widths=(1, 8), tiles=None,
                   deadline: Deadline | None = None) -> list[dict[str, Any]]:
    """The split attention kernel alone (one layer's K/V per call, cycling over 8 layers' caches so nothing is
    served from L2; on a GPU the 8 calls replayed as one CUDA graph): effective bandwidth = unique cache bytes read
    / time, next to the copy bandwidth."""
    from runtime.gpu import attention_kernels as ak

    c = model.cfg
    rows = []
    tiles = tiles or [dict(ak.SPLIT_TILE)]
    saved, saved_pps, saved_rt = dict(ak.SPLIT_TILE), ak.PROGRAMS_PER_SM, ak.ROW_TILE
    try:
        for ctx in contexts:
            for kv_kind in KV_KINDS:
                layers = 8 if DEV == "cuda" else 1
                caches = []
                g = gen(ctx)
                for _ in range(layers):
                    x = torch.randn(2, c.num_key_value_heads, ctx + 16, c.head_dim, device=DEV,
                                    dtype=DT, generator=g)
                    if kv_kind == "bf16":
                        caches.append((x[0], x[1], None, None))
                    else:
                        (kq, ks), (vq, vs) = quantize_q8_0(x[0]), quantize_q8_0(x[1])
                        caches.append((kq, vq, ks, vs))
                    del x
                nbytes = (kv_bytes_per_position(model, kv_kind) // c.num_hidden_layers) * ctx
                for w in widths:
                    for tile in tiles:
                        if deadline is not None and deadline.over():
                            return rows
                        chunk = tile.get("CHUNK")            # one chunk size everywhere, or None: KV_TIERS
                        ak.PROGRAMS_PER_SM = tile.get("PPS", saved_pps)
                        ak.ROW_TILE = tile.get("RT", saved_rt)
                        ak.SPLIT_TILE.clear()
                        ak.SPLIT_TILE.update({k: v for k, v in tile.items() if k not in ("CHUNK", "PPS", "RT")})
                        q = torch.randn(w, c.num_attention_heads, c.head_dim, device=DEV, dtype=DT)
                        pos = torch.arange(ctx - w, ctx, device=DEV, dtype=torch.int32)
                        nch = -(-(ctx + 16) // chunk) if chunk else partial_chunks(w, ctx + 16)
                        part = torch.empty((w * c.num_attention_heads * nch * (c.head_dim + 2)),
                                           device=DEV, dtype=torch.float32)
                        kw = dict(part=part, chunk=chunk)

                        def calls(q=q, pos=pos, kw=kw, caches=caches) -> None:
                            for kc, vc, ks, vs in caches:
                                ak.attention(q, kc, vc, pos, c.head_dim ** -0.5, ks=ks, vs=vs, **kw)
                        try:
                            calls()
                            sync()
                            # on a GPU the 8 calls as one CUDA graph: eager, the host's launch overhead (tens of
                            # us a call) is as long as a call and the figure follows the host's speed
                            run = calls
                            if DEV == "cuda":
                                graph = torch.cuda.CUDAGraph()
                                with torch.cuda.graph(graph):
                                    calls()
                                graph.replay()
                                sync()
                                run = graph.replay
                            reps = 5 if DEV == "cuda" else 1
                            timer = Timer()
                            timer.start()
                            for _ in range(reps):
                                run()
                            dt = timer.stop() / (reps * layers)
                            gbs = nbytes / dt / 1e9
                            err = None
                        except Exception as e:   # a tile that does not build: reported, not fatal
                            dt, gbs, err = float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:200]}"
                        rows.append(dict(kind="attention", kv_dtype=kv_kind, context=ctx, width=w, us=dt * 1e6,
                                         GBs=gbs, frac_of_copy=gbs * 1e9 / bw, tile=dict(tile), error=err))
                del caches
                free_cuda()
    finally:
        ak.SPLIT_TILE.clear()
        ak.SPLIT_TILE.update(saved)
        ak.PROGRAMS_PER_SM = saved_pps
        ak.ROW_TILE = saved_rt
    return rows


# ----------------------------------------------------------------------------------------------------- agreement
def agreement(device: str, n_new: int = 96, prompt_tokens: int = 1024) -> dict[str, Any]:
    """The bundled pack, greedy, q8_0 KV against the compute-dtype KV (BF16 on CUDA, fp32 on CPU): tokens until
    the first difference, and top-1 agreement when both read the same (compute-dtype run's) continuation. On CPU a
    BF16 KV cache is measured the same way, for scale."""
    from runtime.engine import Engine

    kinds = {"ref": None, "q8_0": "q8_0"} | ({"bf16": "bf16"} if device == "cpu" else {})
    engs = {k: Engine.build(NANO, "none", device=device, context=prompt_tokens + n_new + 8, kv_dtype=v)
            for k, v in kinds.items()}
    res: dict[str, Any] = {"device": device, "dtype": str(engs["ref"].model.lm_head.weight.dtype), "prompts": {}}
    for name, text in task_prompts().items():
        ids = engs["ref"].tokenizer.encode(text).ids[:prompt_tokens]
        out = {k: e.generate(ids, max_new_tokens=n_new, stop_ids=set()).token_ids for k, e in engs.items()}

        def first_diff(k: str, out: dict[str, list[int]] = out) -> int:
            return next((i for i, (a, b) in enumerate(zip(out["ref"], out[k], strict=False)) if a != b), n_new)

        full = torch.tensor([ids + out["ref"][:-1]], device=device)
        top1 = {}
        with torch.no_grad():
            for k, e in engs.items():
                e.kv.reset()
                logits = []
                for s in range(0, full.shape[1], 512):
                    logits.append(e.model(full[:, s:s + 512], kv=e.kv).logits[0])
                top1[k] = torch.cat(logits)[len(ids) - 1:].argmax(-1)
        agree = float((top1["ref"] == top1["q8_0"]).float().mean())
        first = first_diff("q8_0")
        res["prompts"][name] = {"prompt_tokens": len(ids), "new_tokens": n_new, "tokens_until_first_difference": first,
                                "top1_agreement": agree}
        if "bf16" in engs:
            res["prompts"][name].update(bf16_tokens_until_first_difference=first_diff("bf16"),
                                        bf16_top1_agreement=float((top1["ref"] == top1["bf16"]).float().mean()))
        print(f"  agreement {name}: q8_0 first difference at {first}/{n_new}, top-1 agreement {100 * agree:.1f}%"
              + (f"; bf16 KV: {first_diff('bf16')}, {100 * res['prompts'][name]['bf16_top1_agreement']:.1f}%"
                 if "bf16" in engs else ""), flush=True)
    p = list(res["prompts"].values())
    res["mean_top1_agreement"] = sum(x["top1_agreement"] for x in p) / len(p)
    res["min_tokens_until_first_difference"] = min(x["tokens_until_first_difference"] for x in p)
    return res


# ----------------------------------------------------------------------------------------------------- checks
def checks(args) -> dict[str, Any]:
    """Correctness on the GPU, BF16: row invariance of the split attention across widths 1/8/16 at 3 context
    lengths (kernel, and the whole A3B step), split = unsplit up to rounding, the prefill attention on the flash
    kernel (also over a q8_0 cache), greedy speculative = target-only on the bundled pack (BF16 and q8_0 KV)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from runtime.gpu import attention_kernels as ak
    from runtime.gpu.static_step import StaticStep
    from runtime.models.layers import cached_attention

    out: dict[str, Any] = {"ok": True, "kv_tiers": KV_TIERS, "one_row_chunks": ONE_ROW_CHUNKS,
                           "one_row_chunks_q8": ONE_ROW_CHUNKS_Q8}

    def record(name: str, ok: bool, **info: Any) -> None:
        out[name] = {"ok": bool(ok), **info}
        out["ok"] &= bool(ok)
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {info}", flush=True)

    nh, nkv, hd = (32, 4, 128) if DEV == "cuda" else (8, 2, 64)
    g = gen(0)
    contexts = CHECK_CONTEXTS
    parts = set(args.check_parts.split(","))
    for kv_kind in KV_KINDS if "attention" in parts else ():
        for ctx in contexts:
            S = ctx + 16
            x = torch.randn(2, nkv, S, hd, device=DEV, dtype=DT, generator=g)
            if kv_kind == "bf16":
                kc, vc, ks, vs = x[0], x[1], None, None
                keys, vals = kc.float(), vc.float()
            else:
                (kc, ks), (vc, vs) = quantize_q8_0(x[0]), quantize_q8_0(x[1])
                keys = (kc.float().view(nkv, S, hd // 32, 32) * ks.float()[..., None]).view(nkv, S, hd)
                vals = (vc.float().view(nkv, S, hd // 32, 32) * vs.float()[..., None]).view(nkv, S, hd)
            q = torch.randn(16, nh, hd, device=DEV, dtype=DT, generator=g)
            pos = torch.arange(ctx - 16, ctx, device=DEV, dtype=torch.int32)

            def att(qq, pp, chunk=None, c=(kc, vc, ks, vs)):
                return ak.attention(qq, c[0], c[1], pp, hd ** -0.5, ks=c[2], vs=c[3], chunk=chunk)

            o16 = att(q, pos)
            o8 = att(q[8:], pos[8:])
            o1 = torch.stack([att(q[r:r + 1], pos[r:r + 1])[0] for r in range(16)])
            mixed = att(torch.cat([q[3:4], torch.randn_like(q[:7])]),
                        torch.cat([pos[3:4], torch.randint(0, ctx, (7,), device=DEV, dtype=torch.int32)]))[0]
            # widths of 2+ rows share one tile: a row's bits are the same at 8 and 16 rows and whatever its
            # neighbours; one row alone takes ROW_TILE_ONE's tile (ROW_TILE_ONE_Q8's over a q8_0 cache) and the
            # chunks of its own length (runtime/kv.py ONE_ROW_CHUNKS, ONE_ROW_CHUNKS_Q8 over a q8_0 cache, where
            # set), the same bits only where both are the wider windows'
            one_tile, wide_tile = (ak.ROW_TILE_ONE, ak.ROW_TILE) if kv_kind == "bf16" else \
                (ak.ROW_TILE_ONE_Q8, ak.ROW_TILE_Q8)
            one_layout = (ONE_ROW_CHUNKS if kv_kind == "bf16" else ONE_ROW_CHUNKS_Q8) is not None
            one_same = torch.equal(o16, o1) if one_tile == wide_tile and not one_layout else \
                float((o1.float() - o16.float()).norm() / o16.float().norm()) < 1e-2
            same = torch.equal(o16[8:], o8) and torch.equal(mixed, o16[3]) and one_same
            unsplit = att(q, pos, chunk=1 << max(0, (S - 1).bit_length()))
            rel_unsplit = float((o16.float() - unsplit.float()).norm() / unsplit.float().norm())
            r = 15
            kk = keys[:, : int(pos[r]) + 1].repeat_interleave(nh // nkv, 0)
            vv = vals[:, : int(pos[r]) + 1].repeat_interleave(nh // nkv, 0)
            a = torch.softmax((q[r].float()[:, None] @ kk.transpose(1, 2))[:, 0] * hd ** -0.5, -1)
            ref = (a[:, None] @ vv)[:, 0]
            rel_ref = float((o16[r].float() - ref).norm() / ref.norm())
            record(f"attention_{kv_kind}_ctx{ctx}", same and rel_unsplit < 1e-2 and rel_ref < 2e-2,
                   row_invariant=same, rel_vs_unsplit=rel_unsplit, rel_vs_fp32=rel_ref)
            del x, keys, vals
    free_cuda()

    # the whole A3B step (graphs), random KV at three lengths: what greedy speculation needs is that, at the
    # engine's one width W, a token's logits are the same bits verified at row k of a window (after k drafted rows)
    # as decoded alone after those k rows were committed. Across widths only the Triton kernels are invariant
    # (cuBLAS may round a 1-row and a 16-row matmul differently), so that comparison is reported, not required.
    model, _ = build_a3b()
    for kv_kind in KV_KINDS if "step" in parts else ():
        kv = make_kv(model, max(contexts) + 16, kv_kind, capacity=max(contexts) + 64)
        steps = {w: StaticStep(model, kv, w, graph=True) for w in (1, 8, 16)}
        tok = torch.randint(0, model.cfg.vocab_size, (1, 16), device=DEV, generator=g)
        for ctx in contexts:
            same, diffs, first = True, {}, {}
            for w, st in steps.items():
                k = min(5, w - 1)
                kv.length = ctx
                in_window = st(tok[:, :w], kv).logits[0, k].clone()     # row k, after k rows of the window
                kv.length = ctx
                if k:
                    st(tok[:, :k], kv)                                  # commit the k rows, then the token alone
                alone = st(tok[:, k:k + 1], kv).logits[0, 0].clone()
                same &= torch.equal(in_window, alone)
                diffs[w] = float((in_window - alone).abs().max())
                kv.length = ctx
                first[w] = st(tok[:, :1], kv).logits[0, 0].clone()
            errs = sorted({e for st in steps.values() for e in st.errors})
            record(f"step_{kv_kind}_ctx{ctx}", same and not errs, in_window_equals_alone=same, max_diff=diffs,
                   across_widths_equal=torch.equal(first[1], first[8]) and torch.equal(first[1], first[16]),
                   across_widths_max_diff=float((first[1] - first[16]).abs().max()),
                   graph=all(s.use_graph for s in steps.values()), fused=all(s.fused for s in steps.values()),
                   errors=errs)
        del steps, kv
        free_cuda()

    # prefill: the flash kernel takes a 2048-row chunk at a 32k context, over BF16 and a dequantized q8_0 cache
    qn = torch.randn(1, nh, 2048, hd, device=DEV, dtype=DT, generator=g)
    for kv_kind in KV_KINDS if DEV == "cuda" and "prefill" in parts else ():
        cache = KVCache(1, nkv, hd, 32768, dtype=DT, device=DEV,
                        quant=None if kv_kind == "bf16" else kv_kind)
        layer = cache.layer(0)
        kn = torch.randn(1, nkv, 32768, hd, device=DEV, dtype=DT, generator=g)
        layer.write(kn, kn * 0.9, 0)
        keys, vals = layer.read(32768, DT)
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = cached_attention(qn, keys, vals, hd ** -0.5)
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                small = cached_attention(qn[:, :, :256], keys[:, :, :4096], vals[:, :, :4096], hd ** -0.5)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                small_f = cached_attention(qn[:, :, :256], keys[:, :, :4096], vals[:, :, :4096], hd ** -0.5)
            rel = float((small_f.float() - small.float()).norm() / small.float().norm())
            record(f"prefill_flash_{kv_kind}", bool(torch.isfinite(o).all()) and rel < 1e-2, rel_vs_other=rel)
        except RuntimeError as e:
            record(f"prefill_flash_{kv_kind}", False, error=str(e)[:300])
        del cache, kn, keys, vals
    del model
    free_cuda()

    # greedy speculative == target-only on the bundled pack (MTP), over several chunks of context
    if (NANO / "model.safetensors").is_file() and "greedy" in parts:
        from runtime.engine import Engine

        text = " ".join(task_prompts().values())
        for kv_kind in KV_KINDS:
            eng = Engine.build(NANO, "mtp", device=DEV, context=2048, block=4,
                               kv_dtype=None if kv_kind == "bf16" else kv_kind)
            ids = eng.tokenizer.encode(text).ids[:1300]
            a = eng.generate(ids, max_new_tokens=120, stop_ids=set(), draft=False).token_ids
            spec = eng.generate(ids, max_new_tokens=120, stop_ids=set())
            b, st = spec.token_ids, spec.stats
            errs = list(eng.step.errors) if eng.step is not None else []
            record(f"greedy_speculative_{kv_kind}", a == b and not errs, tokens=len(a),
                   first_difference=next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None),
                   accepted=st.get("accepted"), windows=st.get("windows"), errors=errs)
            del eng
            free_cuda()
        out["agreement"] = agreement(DEV, n_new=args.agree_tokens, prompt_tokens=args.agree_prompt)
    return out


# ----------------------------------------------------------------------------------------------------- main
def _interpreter_shims() -> None:
    """--smoke: the Triton CPU interpreter, made to accept what compiled Triton accepts (loaded scalars as loop
    bounds; masks that the interpreter types as int32)."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    from triton.runtime import interpreter as interp

    orig = interp._patch_lang_tensor

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    native = interp._interpreter

    class Native:
        def __getattr__(self, name):
            return getattr(native, name)

        @staticmethod
        def load(ptrs, mask, other, dtype):
            return native.load(ptrs, mask.astype(bool), other, dtype)

        @staticmethod
        def store(ptrs, value, mask):
            return native.store(ptrs, value, mask.astype(bool))

    interp._interpreter = Native()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (everything) or cpu (the q8_0 agreement on the pack only)")
    ap.add_argument("--check", action="store_true", help="correctness only; exit 1 when a check fails")
    ap.add_argument("--quick", action="store_true", help="contexts 4k and 32k, one prefill, no transformers")
    ap.add_argument("--max-seconds", type=float, default=210)
    ap.add_argument("--contexts", default="", help="comma-separated decode contexts (default 1k,4k,16k,32k,128k)")
    ap.add_argument("--prefill", default="", help="comma-separated prompt lengths (default 2k,8k,32k)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="the engine's prefill chunk (default: its own)")
    ap.add_argument("--extra-chunks", default="", help="more BF16 prefill chunk sizes to time, e.g. 512,8192")
    ap.add_argument("--kv", default=",".join(KV_KINDS))
    ap.add_argument("--capacity", type=int, default=0, help="positions each decode row's cache holds (default: the "
                    "context + 64); an engine's cache holds its configured context")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--tune", action="store_true", help="also time other attention tiles (kernel alone)")
    ap.add_argument("--agree-tokens", type=int, default=128, help="greedy tokens per prompt for the q8_0 agreement")
    ap.add_argument("--agree-prompt", type=int, default=1024, help="prompt tokens for the q8_0 agreement")
    ap.add_argument("--check-parts", default="attention,step,prefill,greedy", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)   # plumbing test on CPU, tiny model
    args = ap.parse_args(argv)

    if args.smoke:
        global DEV, DT, CHECK_CONTEXTS
        _interpreter_shims()
        DEV, DT, CHECK_CONTEXTS = "cpu", torch.float32, (300, 600)
        args.agree_tokens, args.agree_prompt = 8, 64
    elif args.device == "cpu":
        res = agreement("cpu", n_new=args.agree_tokens, prompt_tokens=args.agree_prompt)
        write_json("context_agreement_cpu.json", {"machine": machine(), "agreement": res})
        return 0
    if DEV == "cuda" and not torch.cuda.is_available():
        print("bench/context.py needs a CUDA GPU (or --device cpu for the q8_0 agreement on the bundled pack).")
        return 2
    if args.check:
        t0 = time.perf_counter()
        res = checks(args)
        res["seconds"] = time.perf_counter() - t0
        res["machine"] = machine()
        if not args.smoke:
            write_json("context_check.json", res)
        print(f"context checks: {'ok' if res['ok'] else 'FAILED'} in {res['seconds']:.0f} s")
        return 0 if res["ok"] else 1

    preset = SMOKE if args.smoke else QUICK if args.quick else DEFAULT
    args.contexts = [int(x) for x in args.contexts.split(",") if x] or list(preset["contexts"])
    args.prefill = [int(x) for x in args.prefill.split(",") if x] or list(preset["prefill"])
    args.widths = list(preset["widths"])
    args.steps = preset["steps"]
    args.kv = [k for k in args.kv.split(",") if k]
    args.extra_chunks = [x for x in args.extra_chunks.split(",") if x]
    args.hf_decode = [] if args.no_hf else list(preset["hf_decode"])
    args.hf_prefill = [] if args.no_hf else list(preset["hf_prefill"])
    deadline = Deadline(args.max_seconds)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}, "kv_tiers": KV_TIERS,
                           "one_row_chunks": ONE_ROW_CHUNKS, "one_row_chunks_q8": ONE_ROW_CHUNKS_Q8,
                           "moe_split_tile": moe_split.TILE}
    bw = copy_bandwidth() if DEV == "cuda" else 1e11
    peak = matmul_peak() if DEV == "cuda" else 1e12
    res.update(copy_bandwidth_GBs=bw / 1e9, matmul_peak_TFLOPs=peak / 1e12)
    print(f"copy {bw / 1e9:,.0f} GB/s (read + write), bf16 matmul {peak / 1e12:,.0f} TFLOP/s", flush=True)
    model, cfg_json = build_a3b()
    dist = experts_per_window(model)
    res["distinct_experts_per_layer"] = dist
    print(f"distinct experts per layer (honest routing): {dist}", flush=True)

    from runtime.gpu import attention_kernels as ak

    tiles = None
    if args.tune:
        # RT: query-head lines per program (rows x GQA group); RT 8 on the A3B shape (group 8) is one row per
        # program: every row of a window reads the whole cache (the kernel before row blocks). CHUNK: one chunk
        # size everywhere; None: the shipped KV_TIERS
        tiles = [dict(BS=b, num_warps=w, num_stages=s, CHUNK=ch, PPS=pps, RT=rt) for b, w, s, ch, pps, rt in
                 ((64, 4, 2, 256, 4, 8), (64, 4, 3, None, 4, 64), (64, 4, 3, 512, 4, 64), (64, 4, 3, 1024, 4, 64),
                  (64, 4, 2, None, 4, 64), (64, 4, 3, None, 4, 32), (64, 4, 3, None, 2, 64))]
    attn = attention_rows(model, bw, tiles=tiles, widths=(1, 8, 16) if DEV == "cuda" else (1,), deadline=deadline,
                          contexts=(32768, 131072) if DEV == "cuda" else (600,))
    rows = decode_rows(model, args, bw, dist, Deadline(min(deadline.left(), args.max_seconds * 0.45)))
    rows += prefill_rows(model, args, peak, Deadline(min(deadline.left(), args.max_seconds * 0.35)))
    try:
        rows += hf_rows(model, cfg_json, args, bw, peak, dist, deadline)
    except Exception as e:   # transformers missing or failing: the runtime's rows still stand
        res["hf_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  transformers: {res['hf_error']}", flush=True)
    del model
    free_cuda()
    res["rows"] = rows
    res["attention_kernel"] = attn
    res["split_tile"] = dict(ak.SPLIT_TILE) | {"ROW_TILE": ak.ROW_TILE}
    if not deadline.over() and (NANO / "model.safetensors").is_file():
        res["agreement"] = agreement(DEV, n_new=args.agree_tokens, prompt_tokens=args.agree_prompt)
    res["seconds"] = time.perf_counter() - t0

    def pick(kind, impl, kv, ctx, w):
        return next((r for r in rows if (r["kind"], r["impl"], r["kv_dtype"], r["context"]) == (kind, impl, kv, ctx)
                     and (w is None or r["width"] == w)), None)

    table = []
    for ctx in sorted({r["context"] for r in rows if r["kind"] == "decode"}):
        for w in args.widths:
            line: list[Any] = [ctx, w]
            for kv in KV_KINDS:
                r = pick("decode", "strata", kv, ctx, w)
                line += [r["tok_s"], r["bound_tok_s"], 100 * r["frac_of_bound"]] if r else [None] * 3
            h = pick("decode", "transformers", "bf16", ctx, None) if w == 1 else None
            line.append(h["tok_s"] if h else None)
            table.append(line)
    print_table(f"decode on {res['machine'].get('gpu')}, A3B shape, honest routing ({dist.get(8, 0):.0f} experts/layer "
                f"at W=8); tok/s = steps/s", ["context", "W", "bf16 tok/s", "bf16 bound", "bf16 %",
                                              "q8_0 tok/s", "q8_0 bound", "q8_0 %", "transformers tok/s"], table)
    ptable = [[r["context"], r["kv_dtype"], r.get("chunk", "-") if r["impl"] == "strata" else "one pass", r["impl"],
               r["tok_s"], r["bound_tok_s"], 100 * r["frac_of_bound"]] for r in rows if r["kind"] == "prefill"]
    print_table(f"prefill (bound: bf16 matmul {peak / 1e12:.0f} TFLOP/s / FLOPs per token)",
                ["prompt", "kv", "chunk", "impl", "tok/s", "bound tok/s", "% bound"], ptable)
    print_table(f"split attention kernel alone (copy {bw / 1e9:,.0f} GB/s)",
                ["context", "kv", "W", "tile BS/warps/stages(/chunk/per SM)", "us/layer", "GB/s", "% copy"],
                [[a["context"], a["kv_dtype"], a["width"], "/".join(str(v) for v in a["tile"].values()), a["us"],
                  a["GBs"], 100 * a["frac_of_copy"]] for a in attn])
    if not args.smoke:
        write_json("context.json", res)
    print(f"total {res['seconds']:.0f} s")
    if args.smoke:      # the plumbing test (tests/test_bench_context.py): any kernel that failed or fell back fails it
        bad = [f"attention {a['kv_dtype']} W={a['width']}: {a['error']}" for a in attn if a.get("error")]
        bad += [f"decode {r['kv_dtype']} W={r['width']}: {r['errors']}" for r in rows if r.get("errors")]
        for b in bad:
            print(f"  FAIL {b}", flush=True)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
