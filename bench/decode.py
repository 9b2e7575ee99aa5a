"""Target-only decode: strata-run vs transformers `generate` (bf16, same GPU, same weights, same prompts).

    python bench/decode.py [--new-tokens 128] [--hf-tokens 16] [--skip-30b] [--max-seconds 240]

Two targets: the bundled pack (setup_wizard/bundled/strata-nano, when present) and a Qwen3-30B-A3B-shaped model with
random weights built directly on the GPU (48 layers, 128 experts top-8, hidden 2048, moe_intermediate 768, 32 q / 4
kv heads x 128, vocab 151936). The transformers model shares our tensors on the device (no copy). Rows:
- `strata (graph)`: the engine's path: fixed-width step captured as a CUDA graph, Triton attention + grouped MoE;
- `strata (eager, before)`: the plain forward per step with the per-expert loop (the runtime before the fast path);
- `transformers generate`: greedy, bf16.
tok/s is decode only (the first token comes from prefill). The bandwidth bound is the measured device-to-device
copy bandwidth / active bytes per token (dense weights without the embedding table, top-k experts of every MoE layer,
the KV cache read at the mean length, the embedding row); `% of bound` = tok/s / bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import (  # noqa: E402
    NANO,
    Deadline,
    copy_bandwidth,
    machine,
    median,
    print_table,
    task_prompts,
    write_json,
)
from runtime.gpu import (
    kernels,  # noqa: E402
    moe_kernels,  # noqa: E402
)
from runtime.gpu.static_step import StaticStep  # noqa: E402
from runtime.kv import KVCache  # noqa: E402
from runtime.models.layers import Rotary, SparseMoe
from runtime.models.qwen3_moe import Qwen3MoeModel
from runtime.models.target_config import Qwen3MoeConfig  # noqa: E402
from runtime.speculative import generate_ids  # noqa: E402

A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "eos_token_id": 151645, "bos_token_id": None,
}


# ----------------------------------------------------------------------------------------------------- models
def build_random_on_gpu(cfg_json: dict, seed: int = 0, std: float = 0.02, device: str = "cuda") -> Qwen3MoeModel:
    """Our model with random BF16 weights created on the GPU (no CPU copy); experts stacked per layer."""
    dev = torch.device(device)
    cfg = Qwen3MoeConfig.from_dict(cfg_json)
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    g = torch.Generator(device=dev)
    g.manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16, device=dev).normal_(0.0, std, generator=g)

    for layer in model.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            gu = rand(mlp.n_exp, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
            dn = rand(mlp.n_exp, cfg.hidden_size, cfg.moe_intermediate_size)
            inter = cfg.moe_intermediate_size
            for e, ex in enumerate(mlp.experts):
                ex.gate_proj.weight = nn.Parameter(gu[e, :inter], requires_grad=False)
                ex.up_proj.weight = nn.Parameter(gu[e, inter:], requires_grad=False)
                ex.down_proj.weight = nn.Parameter(dn[e], requires_grad=False)
            mlp.gate_up, mlp.down = gu, dn
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner)
        val = torch.ones(p.shape, dtype=torch.bfloat16, device=dev) if "norm" in name else rand(*p.shape)
        setattr(mod, attr, nn.Parameter(val, requires_grad=False))
    model.rotary = Rotary(cfg).to(dev)
    return model.eval()


def hf_twin(model: Qwen3MoeModel, cfg_json: dict):
    """transformers' Qwen3MoeForCausalLM over the same device tensors (assign=True: shared storage, no copy)."""
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers import Qwen3MoeForCausalLM

    keep = {k: v for k, v in cfg_json.items() if k not in ("num_nextn_predict_layers", "architectures", "model_type")}
    hfc = HFConfig(**keep)
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(hfc)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or ".mlp.experts." in name:
            continue
        state[name] = p.data
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, SparseMoe):
            if layer.mlp.gate_up is None:
                layer.mlp.stack_experts()
            state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = layer.mlp.gate_up
            state[f"model.layers.{i}.mlp.experts.down_proj"] = layer.mlp.down
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"transformers twin: missing {missing[:3]}, unexpected {unexpected[:3]}")
    dev = model.lm_head.weight.device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hfc).to(dev)
    for n, b in hf.named_buffers():
        if b.is_meta:
            raise RuntimeError(f"transformers twin: buffer {n} left on meta")
    return hf.eval()


def active_bytes(model: Qwen3MoeModel, mean_len: float) -> int:
    """Bytes one decode token must read: dense weights (embedding: one row), top-k experts per MoE layer, KV."""
    cfg = model.cfg
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or ".mlp.experts." in name or name == "model.embed_tokens.weight":
            continue
        total += p.numel() * p.element_size()
    el = model.lm_head.weight.element_size()
    total += cfg.hidden_size * el
    n_moe = sum(isinstance(layer.mlp, SparseMoe) for layer in model.model.layers)
    total += n_moe * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * el
    total += int(cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * el * mean_len)
    return total


# ----------------------------------------------------------------------------------------------------- timing
def run_ours(model, prompt: list[int], n_new: int, *, graph: bool, capacity: int) -> dict[str, Any]:
    cfg = model.cfg
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity,
                 dtype=torch.bfloat16, device="cuda")
    step = StaticStep(model, kv, 1, graph=True) if graph else None
    generate_ids(model, kv, prompt, max_new_tokens=4, stop_ids=set(), step=step)        # warm-up / capture
    r = generate_ids(model, kv, prompt, max_new_tokens=n_new, stop_ids=set(), step=step)
    out = {"tok_s": r.stats["decode_tok_s"], "tokens": r.token_ids, "new_tokens": n_new,
           "graph": bool(step is not None and step.use_graph), "kernels": bool(step is not None and step.use_kernels),
           "fused": bool(step is not None and step.fused), "errors": list(step.errors) if step is not None else [],
           "moe_tiles": {"up": dict(moe_kernels.MOE_UP), "down": dict(moe_kernels.MOE_DOWN)}}
    del kv, step
    return out


def run_hf(hf, prompt: list[int], n_new: int) -> dict[str, Any]:
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def gen(n: int) -> tuple[float, list[int]]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out[0, len(prompt):].tolist()

    with torch.no_grad():
        gen(2)                                  # warm-up
        t1, _ = gen(1)
        tn, toks = gen(n_new)
    return {"tok_s": (n_new - 1) / max(tn - t1, 1e-9), "tokens": toks, "new_tokens": n_new}


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def bench_target(name: str, model, cfg_json: dict, prompts: dict[str, list[int]], args, bw: float,
                 deadline: Deadline) -> dict[str, Any]:
    rows: dict[str, Any] = {"target": name, "prompts": {}}
    hf = hf_twin(model, cfg_json)
    hf_impl = getattr(hf.config, "_experts_implementation", None)
    cap = max(len(p) for p in prompts.values()) + args.new_tokens + 8
    for pname, ids in prompts.items():
        if deadline.over():
            rows["truncated"] = True
            break
        rec: dict[str, Any] = {"prompt_tokens": len(ids)}
        rec["graph"] = run_ours(model, ids, args.new_tokens, graph=True, capacity=cap)
        kernels.ENABLED = False
        try:
            rec["eager_before"] = run_ours(model, ids, args.eager_tokens, graph=False, capacity=cap)
        finally:
            kernels.ENABLED = True
        rec["transformers"] = run_hf(hf, ids, args.hf_tokens)
        rec["agree_graph_vs_hf"] = agree(rec["graph"]["tokens"], rec["transformers"]["tokens"])
        rec["agree_graph_vs_eager"] = agree(rec["graph"]["tokens"], rec["eager_before"]["tokens"])
        mean_len = len(ids) + args.new_tokens / 2
        rec["active_bytes"] = active_bytes(model, mean_len)
        rec["bound_tok_s"] = bw / rec["active_bytes"]
        rows["prompts"][pname] = rec
        print(f"  {name}/{pname}: graph {rec['graph']['tok_s']:.1f} tok/s, eager {rec['eager_before']['tok_s']:.1f}, "
              f"hf {rec['transformers']['tok_s']:.1f}", flush=True)
    recs = list(rows["prompts"].values())
    if recs:
        g = median([r["graph"]["tok_s"] for r in recs])
        e = median([r["eager_before"]["tok_s"] for r in recs])
        h = median([r["transformers"]["tok_s"] for r in recs])
        b = median([r["bound_tok_s"] for r in recs])
        rows["summary"] = {"graph_tok_s": g, "eager_tok_s": e, "hf_tok_s": h, "ratio_vs_hf": g / h,
                           "graph_vs_eager": g / e, "bound_tok_s": b, "frac_of_bound": g / b,
                           "hf_frac_of_bound": h / b, "hf_experts_implementation": hf_impl,
                           "graph_used": all(r["graph"]["graph"] for r in recs)}
    del hf
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--eager-tokens", type=int, default=32)
    ap.add_argument("--hf-tokens", type=int, default=24)
    ap.add_argument("--skip-30b", action="store_true")
    ap.add_argument("--skip-nano", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=240)
    ap.add_argument("--prompts", default="", help="comma-separated task names for the bundled pack (default all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode.py needs a CUDA GPU.")
    deadline = Deadline(args.max_seconds)
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "targets": {}}
    bw = copy_bandwidth()
    res["copy_bandwidth_GBs"] = bw / 1e9
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)

    if not args.skip_nano and (NANO / "model.safetensors").is_file():
        from runtime.engine import Engine

        eng = Engine.build(NANO, "none", device="cuda", context=4096)
        cfg_json = json.loads((NANO / "config.json").read_text())
        want = [w for w in args.prompts.split(",") if w]
        prompts = {k: eng.tokenizer.encode(v).ids[:512] for k, v in task_prompts().items() if not want or k in want}
        res["targets"]["strata-nano"] = bench_target("strata-nano", eng.model, cfg_json, prompts, args, bw, deadline)
        del eng
        gc.collect()
        torch.cuda.empty_cache()

    if not args.skip_30b and not deadline.over():
        t0 = time.perf_counter()
        model = build_random_on_gpu(A3B)
        torch.cuda.synchronize()
        res["a3b_build_s"] = time.perf_counter() - t0
        n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        res["a3b_params"] = n_params
        g = torch.Generator().manual_seed(1)
        prompts = {"random64": torch.randint(0, A3B["vocab_size"], (64,), generator=g).tolist()}
        args.new_tokens, args.eager_tokens, args.hf_tokens = args.new_tokens, min(args.eager_tokens, 16), \
            min(args.hf_tokens, 12)
        res["targets"]["qwen3-30b-a3b-shape"] = bench_target("qwen3-30b-a3b-shape", model, A3B, prompts, args, bw,
                                                             deadline)
        del model
        gc.collect()
        torch.cuda.empty_cache()

    rows = []
    for name, t in res["targets"].items():
        s = t.get("summary")
        if s:
            rows.append([name, s["graph_tok_s"], s["eager_tok_s"], s["hf_tok_s"], s["ratio_vs_hf"],
                         s["graph_vs_eager"], s["bound_tok_s"], 100 * s["frac_of_bound"], 100 * s["hf_frac_of_bound"]])
    print_table(f"target-only decode on {res['machine'].get('gpu')} (copy {bw / 1e9:.0f} GB/s; medians over prompts)",
                ["target", "strata graph tok/s", "strata eager tok/s", "transformers tok/s", "x transformers",
                 "graph/eager", "bound tok/s", "% bound", "hf % bound"], rows)
    write_json("decode.json", res)
    return res


if __name__ == "__main__":
    main()
