"""Quantized targets: decode speed against the bandwidth bound, and agreement with the BF16 target.

    python bench/quant_target.py --device cuda [--check] [--quants bf16,q8_0,q4_0] [--new-tokens 64]
    python bench/quant_target.py --device cpu --part agreement

Two parts, each written to bench/results/quant_target.json (`$OUT` on the device machine):

- `agreement` (CPU, fp32): the bundled pack converted to BF16, Q8_0 and Q4_0 GGUF files (setup_wizard/convert_target.py)
  and loaded from them. On the held-out calibration prompts (calibrate/prompts: code, long, math, prose; the first
  `--agree-tokens` tokens of each), teacher-forced next-token top-1 agreement with the BF16 file at every position,
  and from the first `--prefix` tokens a greedy continuation of `--gen` tokens: the number of tokens until the first
  difference from BF16's continuation.
- `speed` (CUDA): a Qwen3-30B-A3B-shaped target (48 layers, 128 experts top-8, hidden 2048, moe_intermediate 768,
  32 q / 4 kv heads x 128, vocab 151936) built on the GPU with random weights in each format (BF16 floats; Q8_0,
  Q4_0, K-quant and IQ4 random ggml blocks with a realistic scale: the speed does not depend on the values;
  `q4_k_m` / `q5_k_m`: llama-quantize's Q4_K_M / Q5_K_M mix of Q4_K / Q5_K and Q6_K, `tensor_format`). Decode
  tok/s through the engine's step (CUDA graph when the kernels take the format) against the bound: the
  device-to-device copy bandwidth measured in the same run / the bytes one token must read in that format (dense
  weights with one embedding row, top-k experts of every layer, the KV cache at the mean length).
  `frac_of_bound = tok_s / bound`,
  `vs_bf16 = tok_s / BF16's tok_s`. `tok_s` is the median of three runs with the next step queued before each
  token's read (shipped); `tok_s_after_read` the same runs, alternating, with it queued after the read; `step_tok_s`
  the graphed step alone, replayed 50 times at the prompt's length (the loop's ceiling).
- `--check` first compares, for each format, the GPU paths the speed part uses with the plain dequantize-then-matmul
  reference on one A3B-sized MoE layer and one dense matrix (relative error), and stops with exit code 1 on a miss.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import (  # noqa: E402
    A3B_SHAPE,
    HONEST,
    NANO,
    Deadline,
    build_random_a3b,
    copy_bandwidth,
    machine,
    median,
    print_table,
    task_prompts,
    write_json,
)
from runtime import speculative  # noqa: E402
from runtime.formats.quant_linear import QuantEmbedding, QuantLinear  # noqa: E402
from runtime.formats.registry import FORMATS  # noqa: E402
from runtime.kv import KVCache  # noqa: E402
from runtime.models.layers import Rotary, SparseMoe  # noqa: E402
from runtime.models.qwen3_moe import Qwen3MoeModel  # noqa: E402
from runtime.models.target_config import Qwen3MoeConfig  # noqa: E402
from runtime.speculative import generate_ids  # noqa: E402

QUANTS = ("bf16", "q8_0", "q4_0")
A3B = A3B_SHAPE
STD = 0.02


# ------------------------------------------------------------------------------------------------------ agreement

def first_difference(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.no_grad()
def agreement(args) -> dict[str, Any]:
    """Teacher-forced top-1 agreement and tokens-until-first-difference of each quantized file with the BF16 file."""
    from runtime.loading_gguf import load_target_gguf, load_tokenizer_gguf
    from setup_wizard.convert_target import convert_target

    torch.set_num_threads(max(1, args.threads))
    out: dict[str, Any] = {"target": "strata-nano", "prompts": sorted(task_prompts()), "agree_tokens": args.agree_tokens,
                           "prefix": args.prefix, "gen": args.gen, "quants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        files = {q: convert_target(NANO, q, Path(tmp) / q / "model.gguf").path for q in QUANTS}
        tok = load_tokenizer_gguf(files["bf16"])
        prompts = {k: tok.encode(v).ids[: args.agree_tokens] for k, v in task_prompts().items()}
        models = {q: load_target_gguf(files[q], with_mtp=False) for q in QUANTS}
        ref_top = {k: models["bf16"](torch.tensor([ids])).logits[0].argmax(-1) for k, ids in prompts.items()}
        ref_gen = {k: _greedy(models["bf16"], ids[: args.prefix], args.gen) for k, ids in prompts.items()}
        for q in QUANTS[1:]:
            per: dict[str, Any] = {}
            hits = total = 0
            for k, ids in prompts.items():
                top = models[q](torch.tensor([ids])).logits[0].argmax(-1)
                same = int((top == ref_top[k]).sum())
                gen = _greedy(models[q], ids[: args.prefix], args.gen)
                per[k] = {"top1": same / len(ids), "positions": len(ids),
                          "tokens_until_difference": first_difference(gen, ref_gen[k])}
                hits, total = hits + same, total + len(ids)
            code = [k for k in per if k in ("code", "long", "math")]
            out["quants"][q] = {
                "top1": hits / total, "positions": total,
                "top1_code": sum(per[k]["top1"] * per[k]["positions"] for k in code)
                / max(1, sum(per[k]["positions"] for k in code)),
                "tokens_until_difference_median": median([float(p["tokens_until_difference"]) for p in per.values()]),
                "prompts": per}
    return out


def _greedy(model, ids: list[int], n: int) -> list[int]:
    cfg = model.cfg
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, len(ids) + n + 8,
                 dtype=torch.float32, device="cpu")
    return generate_ids(model, kv, ids, max_new_tokens=n, stop_ids=set()).token_ids


# ------------------------------------------------------------------------------------------------------ the A3B model

def random_blocks(rows: int, cols: int, fmt: str, g: torch.Generator, device: str = "cuda",
                  std: float = STD) -> torch.Tensor:
    """uint8 [rows, row_bytes] of random ggml blocks whose values have about `std` standard deviation."""
    f = FORMATS[fmt]
    nb = cols // f.block_values
    b = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, device=device, generator=g)
    if fmt in ("q4_k", "q5_k"):   # d, dmin, 6-bit scales and minimums (mean 31.5), nibbles (std 4.6) or 5-bit codes
        cs, mid = (4.6, 7.5) if fmt == "q4_k" else (9.2, 15.5)     # (std 9.2): d * sc * q - dmin * m
        d = torch.full((rows, nb, 2), std / (31.5 * cs), dtype=torch.float16, device=device)
        d[..., 1] *= mid                                       # dmin * m about d * sc * mid: values centred
        b[..., :4] = d.view(torch.uint8).reshape(rows, nb, 4)
        return b.reshape(rows, nb * f.block_bytes)
    if fmt in ("q6_k", "q3_k"):   # Q6_K: codes q - 32 (std 18.5), int8 scales (mean |sc| 64); Q3_K: codes -4..3
        # (std 2.3), 6-bit scales minus 32 (rms 18.5); d last: d * sc * q
        d = torch.full((rows, nb, 1), std / (64 * 18.5 if fmt == "q6_k" else 18.5 * 2.3), dtype=torch.float16,
                       device=device)
        b[..., f.block_bytes - 2:] = d.view(torch.uint8).reshape(rows, nb, 2)
        return b.reshape(rows, nb * f.block_bytes)
    if fmt in ("iq4_xs", "iq4_nl"):   # levels kv[code] (rms 66); IQ4_XS: 6-bit scales minus 32 (rms 18.5); d first
        d = torch.full((rows, nb, 1), std / (66 * (18.5 if fmt == "iq4_xs" else 1)), dtype=torch.float16,
                       device=device)
        b[..., :2] = d.view(torch.uint8).reshape(rows, nb, 2)
        return b.reshape(rows, nb * f.block_bytes)
    if fmt == "q2_k":     # 4-bit scales and minimums (mean 7.5), 2-bit codes (std 1.1), d and dmin last
        d = torch.full((rows, nb, 2), std / (7.5 * 1.1), dtype=torch.float16, device=device)
        d[..., 1] *= 1.5                                       # dmin * m about d * sc * 1.5: values centred
        b[..., 80:84] = d.view(torch.uint8).reshape(rows, nb, 4)
        return b.reshape(rows, nb * f.block_bytes)
    code_std = 74.0 if fmt == "q8_0" else 4.6 if fmt == "q4_0" else 9.2     # uniform int8 / nibble / 5-bit codes
    d = torch.full((rows, nb, 1), std / code_std, dtype=torch.float16, device=device)
    b[..., :2] = d.view(torch.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, nb * f.block_bytes)


# llama-quantize's Q4_K_M (its use_more_bits rule): Q4_K everywhere except attn_v and ffn_down(_exps) of the layers
# in the first and last eighth and every third layer between (Q6_K), and the output head (Q6_K); token_embd Q4_K.
# Q5_K_M: the same with Q5_K in place of Q4_K. `q3_k_m`, a Q3_K_M-like mix (llama-quantize's own rule differs in
# detail): Q3_K, with Q5_K where Q4_K_M takes Q6_K, a Q4_K o_proj and a Q6_K head
MIXES = ("q4_k_m", "q5_k_m", "q3_k_m")


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_format(fmt: str, role: str, layer: int = 0, n_layers: int = 1) -> str:
    """The block format of one tensor of a target built as `fmt` (a format name, or a mix of `MIXES`). role: one of
    gate_up, down, q_proj, k_proj, v_proj, o_proj, embed, lm_head."""
    if fmt not in MIXES:
        return fmt
    if role == "lm_head":
        return "q6_k"
    if role in ("down", "v_proj") and _more_bits(layer, n_layers):
        return "q5_k" if fmt == "q3_k_m" else "q6_k"
    if fmt == "q3_k_m" and role == "o_proj":
        return "q4_k"
    return fmt[:4]


def model_active_bytes(model, mean_len: float) -> int:
    """Bytes one decode token reads from a built model: every dense matrix and norm as held (the embedding one
    row), the top-k experts of every layer as held, the BF16 KV cache at `mean_len` positions. For a mix of formats,
    where `active_bytes` takes one format for every tensor."""
    cfg = model.cfg
    emb = model.model.embed_tokens
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, SparseMoe):
            total += cfg.num_experts_per_tok * (m.gate_up[0].numel() * m.gate_up.element_size()
                                                + m.down[0].numel() * m.down.element_size())
            total += sum(p.numel() * p.element_size() for p in m.gate.parameters())
            seen.update(id(p) for p in m.gate.parameters())
            continue
        if m is emb:
            t = emb.blocks if isinstance(emb, QuantEmbedding) else emb.weight
            total += t[0].numel() * t.element_size()
            seen.add(id(t))
            continue
        for t in [*m.parameters(recurse=False), *([m.blocks] if isinstance(m, QuantLinear) else [])]:
            if id(t) not in seen and t.data_ptr() != 0:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    kv = int(cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * mean_len)
    return total + kv


def build_on_gpu(cfg_json: dict, fmt: str, seed: int = 0, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16) -> Qwen3MoeModel:
    """The A3B-shaped model on the GPU with honest routing (bench/common.py): BF16 floats (`build_random_a3b`), or
    (a block format, or a mix of `MIXES`: `tensor_format`) every matrix and the experts as random blocks held
    the way runtime/loading_gguf.py holds a quantized file (norms and router in `dtype`), with the same scales
    (embeddings std 1, residual contributions x 0.05). `device="cpu", dtype=torch.float32` gives the tests a tiny one."""
    if fmt == "bf16":
        return build_random_a3b(cfg_json, device=device, seed=seed)[0]
    dev = torch.device(device)
    res = HONEST["residual_scale"]
    cfg = Qwen3MoeConfig.from_dict(cfg_json)
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    g = torch.Generator(device=dev)
    g.manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=dev).normal_(0.0, STD, generator=g)

    h, mi = cfg.hidden_size, cfg.moe_intermediate_size
    n = cfg.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        fg, fd = tensor_format(fmt, "gate_up", i, n), tensor_format(fmt, "down", i, n)
        gu = random_blocks(mlp.n_exp * 2 * mi, h, fg, g, device).reshape(mlp.n_exp, 2 * mi, -1)
        dn = random_blocks(mlp.n_exp * h, mi, fd, g, device, STD * res).reshape(mlp.n_exp, h, -1)
        mlp.bind_blocks(gu, dn, fg if fg == fd else (fg, fd))
        a = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(a, name)
            std = STD * (res if name == "o_proj" else 1.0)
            f = tensor_format(fmt, name, i, n)
            blocks = random_blocks(lin.out_features, lin.in_features, f, g, device, std)
            setattr(a, name, QuantLinear.from_blocks(blocks, f, lin.in_features))
    fe, fh = tensor_format(fmt, "embed"), tensor_format(fmt, "lm_head")
    model.model.embed_tokens = QuantEmbedding.from_blocks(
        random_blocks(cfg.vocab_size, h, fe, g, device, HONEST["embed_std"]), fe, h, dtype)
    model.lm_head = QuantLinear.from_blocks(random_blocks(cfg.vocab_size, h, fh, g, device), fh, h)
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            owner, _, attr = name.rpartition(".")
            val = torch.ones(p.shape, dtype=dtype, device=dev) if "norm" in name else rand(*p.shape)
            setattr(model.get_submodule(owner), attr, nn.Parameter(val, requires_grad=False))
    model.rotary = Rotary(cfg).to(dev)
    for layer in model.model.layers:      # as ExpertCache.place does on CUDA: q/k/v stacked before the first step
        layer.self_attn.stack_qkv()
    return model.eval()


def active_bytes(cfg_json: dict, fmt: str, mean_len: float) -> int:
    """Bytes one decode token reads in `fmt`: every dense matrix (embedding: one row), norms and router (BF16), top-k
    experts of every layer, the BF16 KV cache at `mean_len` positions."""
    from runtime.models.target_config import TargetGeometry

    t = TargetGeometry.from_config(cfg_json).with_quant(fmt)
    wb = 2
    dense = t.dense_bytes(wb) - t.matrix_bytes(t.vocab, t.hidden, wb) + t.matrix_bytes(1, t.hidden, wb)
    experts = len(t.sparse_layers) * t.top_k * t.expert_bytes(wb)
    kv = int(t.layers * 2 * t.kv_heads * t.head_dim * 2 * mean_len)
    return dense + experts + kv


def run_decode(model, prompt: list[int], n_new: int, capacity: int, reps: int = 3) -> dict[str, Any]:
    """Target-only decode through `generate_ids` (median of `reps` runs), with the next step queued before each
    token's read (`speculative.DECODE_AHEAD`, shipped) and after it, alternating in one run; and the graphed step
    alone at the prompt's length (what the loop would reach with no host time between steps)."""
    from runtime.gpu.static_step import StaticStep

    cfg = model.cfg
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, dtype=torch.bfloat16,
                 device="cuda")
    step = StaticStep(model, kv, 1, graph=True)
    generate_ids(model, kv, prompt, max_new_tokens=4, stop_ids=set(), step=step)    # warm-up / capture
    runs: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    try:
        for _ in range(reps):
            for ahead in (True, False):
                speculative.DECODE_AHEAD = ahead
                r = generate_ids(model, kv, prompt, max_new_tokens=n_new, stop_ids=set(), step=step)
                runs[ahead].append(r.stats["decode_tok_s"])
                tokens[ahead] = r.token_ids
    finally:
        speculative.DECODE_AHEAD = True
    n = len(prompt)
    kv.rollback(n)
    win = torch.tensor([[prompt[-1]]], device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        step(win, kv)
        kv.rollback(n)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) / 50 * 1e3
    out = {"tok_s": median(runs[True]), "tok_s_after_read": median(runs[False]), "tok_s_runs": runs[True],
           "tok_s_after_read_runs": runs[False], "step_ms": step_ms, "step_tok_s": 1e3 / step_ms,
           "same_tokens": tokens[True] == tokens[False], "tokens": tokens[True], "graph": step.use_graph,
           "kernels": step.use_kernels, "fused": step.fused, "errors": list(step.errors)}
    del kv, step
    return out


def speed(args, bw: float, deadline: Deadline) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, A3B["vocab_size"], (64,), generator=g).tolist()
    res: dict[str, Any] = {}
    for q in args.quants:
        if deadline.over():
            res[q] = {"skipped": "out of time"}
            continue
        t0 = time.perf_counter()
        model = build_on_gpu(A3B, q)
        torch.cuda.synchronize()
        build_s = time.perf_counter() - t0
        n_new = args.new_tokens
        rec = run_decode(model, prompt, n_new, len(prompt) + n_new + 16)
        ab = active_bytes(A3B, q, len(prompt) + n_new / 2) if q not in MIXES else \
            model_active_bytes(model, len(prompt) + n_new / 2)
        rec.update(build_s=build_s, active_bytes=ab, bound_tok_s=bw / ab, frac_of_bound=rec["tok_s"] * ab / bw)
        rec.pop("tokens")
        res[q] = rec
        print(f"  {q}: {rec['tok_s']:.1f} tok/s, bound {rec['bound_tok_s']:.0f} ({100 * rec['frac_of_bound']:.0f}%);"
              f" next step queued after the read {rec['tok_s_after_read']:.1f}, the step alone {rec['step_tok_s']:.1f}"
              f" (same tokens: {rec['same_tokens']}) kernels={rec['kernels']} graph={rec['graph']} fused={rec['fused']}", flush=True)
        # llama-bench's `-d D tg128`: D tokens already in the cache, then 128 generated
        for depth in args.depths:
            if deadline.over():
                break
            long_prompt = torch.randint(0, A3B["vocab_size"], (depth,), generator=g).tolist()
            d = run_decode(model, long_prompt, 128, depth + 128 + 16)
            ab = active_bytes(A3B, q, depth + 64) if q not in MIXES else model_active_bytes(model, depth + 64)
            d.pop("tokens")
            d.update(depth=depth, bound_tok_s=bw / ab, frac_of_bound=d["tok_s"] * ab / bw)
            res.setdefault("depths", []).append({"quant": q, **d})
            print(f"  {q} at depth {depth}: {d['tok_s']:.1f} tok/s, bound {d['bound_tok_s']:.0f} "
                  f"({100 * d['frac_of_bound']:.0f}%); after the read {d['tok_s_after_read']:.1f}, the step alone "
                  f"{d['step_tok_s']:.1f}", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    base = res.get("bf16", {}).get("tok_s")
    for r in res.values():
        if base and isinstance(r, dict) and "tok_s" in r:
            r["vs_bf16"] = r["tok_s"] / base
    return res


# ------------------------------------------------------------------------------------------------------ check

@torch.no_grad()
def check(args, device: str = "cuda") -> list[str]:
    """The GPU paths against dequantize-then-matmul, per format: one A3B-sized MoE layer (grouped kernel when it
    takes the format, else the eager per-expert loop), one dense QuantLinear. Problems, empty when all pass."""
    from runtime.formats.blocks import dequantize_torch
    from runtime.gpu import kernels

    problems: list[str] = []
    g = torch.Generator(device=device)
    g.manual_seed(3)
    cfg = Qwen3MoeConfig.from_dict(A3B)
    h, mi = cfg.hidden_size, cfg.moe_intermediate_size
    for q in [q for q in args.quants if q != "bf16" and q not in MIXES]:     # a mix's formats: their own rows
        with torch.device("meta"):
            blk = SparseMoe(cfg)
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        blk.gate = nn.Linear(h, cfg.num_experts, bias=False, device=device, dtype=dt)
        gu = random_blocks(cfg.num_experts * 2 * mi, h, q, g, device).reshape(cfg.num_experts, 2 * mi, -1)
        dn = random_blocks(cfg.num_experts * h, mi, q, g, device).reshape(cfg.num_experts, h, -1)
        blk.bind_blocks(gu, dn, q)
        x = torch.randn(4, h, device=device, dtype=dt)
        w, idx = blk.route(x)
        path = "grouped kernel" if kernels.available(x) else "torch fallback"
        got = blk(x).float()
        ref = torch.zeros(4, h, device=device)
        for t in range(4):
            for j in range(cfg.num_experts_per_tok):
                e = int(idx[t, j])
                wg = dequantize_torch(gu[e, :mi].contiguous(), q)
                wu = dequantize_torch(gu[e, mi:].contiguous(), q)
                wd = dequantize_torch(dn[e].contiguous(), q)
                xf = x[t].float()
                ref[t] += float(w[t, j]) * (wd @ (torch.nn.functional.silu(wg @ xf) * (wu @ xf)))
        rel = ((got - ref).norm() / ref.norm()).item()
        print(f"  check {q} MoE layer ({path}): relative error {rel:.2e}", flush=True)
        if not rel < 2e-2:
            problems.append(f"{q} MoE layer ({path}) relative error {rel:.3g}")
        lin = QuantLinear.from_blocks(random_blocks(4096, h, q, g, device), q, h)
        for rows in (4, 1):             # a dequantized scratch, then the one-row matrix-vector kernel
            y = lin(x[:rows]).float()
            yr = x[:rows].float() @ dequantize_torch(lin.blocks, q).T
            rel = ((y - yr).norm() / yr.norm()).item()
            print(f"  check {q} QuantLinear, {rows} row(s): relative error {rel:.2e}", flush=True)
            if not rel < 2e-2:
                problems.append(f"{q} QuantLinear {rows} row(s) relative error {rel:.3g}")
    return problems


# ------------------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--part", default="all", choices=("all", "agreement", "speed"))
    ap.add_argument("--check", action="store_true", help="check the GPU paths against the reference first")
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depths", default="", help="also decode 128 tokens after prompts of these lengths "
                    "(llama-bench -d), e.g. 4096,32768")
    ap.add_argument("--agree-tokens", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--max-seconds", type=float, default=170)
    ap.add_argument("--k-tiles-before", default="", help="formats (q4_k,q6_k) whose one-row products take "
                    "DECODE_GEMV's tiles (the runtime before dense_kernels.QUANT_ONE_ROW and "
                    "moe_gemv.DECODE_GEMV_ONE_ROW named K-quant tiles): an A/B in two runs of one device call")
    ap.add_argument("--q4k-tiles", default="", help="Q4_K one-row tiles to take instead of the tables': "
                    "comma-separated ROLE=VARIANT, ROLE one of experts, qkv, o_proj, lm_head (an A/B in two runs)")
    args = ap.parse_args(argv)
    args.quants = [q for q in args.quants.split(",") if q]
    if args.q4k_tiles:
        from runtime.gpu import dense_kernels, moe_gemv

        for role, name in (p.partition("=")[::2] for p in args.q4k_tiles.split(",")):
            if role not in ("experts", "qkv", "o_proj", "lm_head") or name not in moe_gemv.GEMV_VARIANTS:
                raise SystemExit(f"--q4k-tiles takes ROLE=VARIANT with ROLE experts, qkv, o_proj or lm_head and a "
                                 f"variant of runtime/gpu/moe_gemv.py GEMV_VARIANTS; got {role}={name}.")
            if role == "experts":
                moe_gemv.DECODE_GEMV_ONE_ROW["q4_k"] = name
            else:
                dense_kernels.QUANT_ONE_ROW[("q4_k", role)] = name
    before = [f for f in args.k_tiles_before.split(",") if f]
    if before:
        from runtime.gpu import dense_kernels, moe_gemv

        for key in [k for k in dense_kernels.QUANT_ONE_ROW if k[0] in before]:
            del dense_kernels.QUANT_ONE_ROW[key]
        for key in before:
            moe_gemv.DECODE_GEMV_ONE_ROW.pop(key, None)
    args.depths = [int(d) for d in args.depths.split(",") if d]
    deadline = Deadline(args.max_seconds)
    res: dict[str, Any] = {"machine": machine(), "args": {k: v for k, v in vars(args).items()}, "rows": []}
    if args.device == "cuda" and args.part in ("all", "speed"):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA GPU; use --device cpu --part agreement here.")
        if args.check:
            problems = check(args, "cuda")
            res["check"] = {"ok": not problems, "problems": problems}
            if problems:
                write_json("quant_target.json", res)
                print("check failed: " + "; ".join(problems))
                raise SystemExit(1)
        bw = copy_bandwidth()
        res["copy_bandwidth_GBs"] = bw / 1e9
        print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
        res["speed"] = speed(args, bw, deadline)
    if args.part in ("all", "agreement"):
        res["agreement"] = agreement(args)
    sp, ag = res.get("speed", {}), res.get("agreement", {}).get("quants", {})
    for q in args.quants:
        s, a = sp.get(q, {}), ag.get(q, {})
        row = {"quant": q, "tok_s": s.get("tok_s"), "tok_s_after_read": s.get("tok_s_after_read"),
               "step_tok_s": s.get("step_tok_s"), "bound_tok_s": s.get("bound_tok_s"),
               "frac_of_bound": s.get("frac_of_bound"), "vs_bf16": s.get("vs_bf16"),
               "top1_agreement": a.get("top1", 1.0 if q == "bf16" else None), "top1_agreement_code": a.get("top1_code"),
               "tokens_until_difference_median": a.get("tokens_until_difference_median")}
        res["rows"].append(row)
    print_table("quantized targets: A3B-shape decode (GPU) and bundled-pack agreement with BF16 (CPU fp32)",
                ["quant", "tok/s", "after read", "step alone", "bound tok/s", "% bound", "x BF16", "top-1 agree",
                 "top-1 (code)", "tokens to 1st diff"],
                [[r["quant"], r["tok_s"], r["tok_s_after_read"], r["step_tok_s"], r["bound_tok_s"],
                  None if r["frac_of_bound"] is None else 100 * r["frac_of_bound"], r["vs_bf16"],
                  r["top1_agreement"], r["top1_agreement_code"], r["tokens_until_difference_median"]]
                 for r in res["rows"]])
    write_json("quant_target.json", res)
    return res


if __name__ == "__main__":
    main()
