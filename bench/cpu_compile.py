"""What torch.compile (inductor's C++ code) could do for the CPU step, on the bundled pack: the shipped step against
the same model written as plain tensor ops, eager and compiled, side by side in one process.

    OMP_NUM_THREADS=1 python bench/cpu_compile.py [--widths 1,5] [--rounds 6] [--steps 30] [--shipped]

The CPU step is paid per op (docs/models.md, "Numerics"), and inductor fuses element-wise ops and runs a graph
without the interpreter and the dispatcher between them. The shipped step does not compile as it is (its routed
experts are Python calls per expert id, so Dynamo breaks the graph and recompiles per id: `--shipped` adds a column with
`StaticStep._forward_plan` itself through `torch.compile`), so this script writes the pack's step in a form that compiles whole: every op on tensors, the row's
experts gathered by index (one row) or every expert on every row weighted by the routing (a window, as
`SparseMoe.dense` does), the attention over the cache up to the window's last position with a causal mask (a
dynamic length). Reported per width: ms per step (process time, median of interleaved rounds), the shipped step's
next to the plain form eager and compiled, the compile time, and the compiled logits against the shipped ones (max
|difference|, top-1 agreement). A measurement of what a compiled step could give, not a runtime path: a compiled
step's bits depend on inductor's code, so the lossless promise (a row's bits the same at every width) would need
checking before any use. Writes `cpu_compile.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import NANO, machine, median, print_table, task_prompts, write_json  # noqa: E402


def weights(model) -> dict[str, Any]:
    """The pack's tensors as plain [in, out] matrices (fp32 copies: the step below owns them)."""
    cfg = model.cfg
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        wqkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).float().t().contiguous()
        gu = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)).float().t() for e in m.experts])
        dn = torch.stack([e.down_proj.weight.float().t() for e in m.experts])
        layers.append(dict(ln1=layer.input_layernorm.weight.float(), ln2=layer.post_attention_layernorm.weight.float(),
                           wqkv=wqkv, qn=a.q_norm.weight.float(), kn=a.k_norm.weight.float(),
                           wo=a.o_proj.weight.float().t().contiguous(), wr=m.gate.weight.float().t().contiguous(),
                           gu=gu.contiguous(), dn=dn.contiguous()))
    from runtime.models.layers import rope_inv_freq

    inv, scale = rope_inv_freq(cfg)
    return dict(layers=layers, emb=model.model.embed_tokens.weight.float(), norm=model.model.norm.weight.float(),
                head=model.lm_head.weight.float().t().contiguous(), inv=inv, rscale=scale, eps=cfg.rms_norm_eps,
                nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=cfg.head_dim, k=cfg.num_experts_per_tok,
                inter=cfg.moe_intermediate_size, norm_topk=cfg.norm_topk_prob)


def plain_step(P: dict[str, Any], ids: torch.Tensor, start: int, kcs: list, vcs: list) -> torch.Tensor:
    """Logits of the window ids [W] at positions start.. (its K/V written into kcs/vcs [nkv, S, hd])."""
    nh, nkv, hd, eps, k, inter = P["nh"], P["nkv"], P["hd"], P["eps"], P["k"], P["inter"]
    W = ids.shape[0]
    pos = start + torch.arange(W)
    x = P["emb"][ids]                                            # [W, H]
    f = pos[:, None].float() * P["inv"][None, :]
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos() * P["rscale"], emb.sin() * P["rscale"]   # [W, hd]
    n = start + W
    mask = torch.arange(kcs[0].shape[1])[None, :] <= pos[:, None]   # [W, S]

    def rope(t):                                                  # [W, heads, hd]
        h = hd // 2
        return t * cos[:, None] + torch.cat((-t[..., h:], t[..., :h]), -1) * sin[:, None]
    for i, L in enumerate(P["layers"]):
        h = F.rms_norm(x, (x.shape[-1],), L["ln1"], eps)
        q, kk, v = (h @ L["wqkv"]).split((nh * hd, nkv * hd, nkv * hd), -1)
        q = rope(F.rms_norm(q.view(W, nh, hd), (hd,), L["qn"], eps))
        kk = rope(F.rms_norm(kk.view(W, nkv, hd), (hd,), L["kn"], eps))
        kc, vc = kcs[i], vcs[i]
        kc[:, start:n] = kk.transpose(0, 1)
        vc[:, start:n] = v.view(W, nkv, hd).transpose(0, 1)
        qg = q.view(W, nkv, nh // nkv, hd).permute(1, 0, 2, 3).reshape(nkv, W * (nh // nkv), hd)
        s = torch.bmm(qg, kc[:, :n].transpose(1, 2)) * hd ** -0.5            # [nkv, W*g, n]
        s = s.view(nkv, W, nh // nkv, n).masked_fill(~mask[None, :, None, :n], float("-inf"))
        o = torch.bmm(torch.softmax(s, -1).view(nkv, W * (nh // nkv), n), vc[:, :n])
        o = o.view(nkv, W, nh // nkv, hd).permute(1, 0, 2, 3).reshape(W, nh * hd)
        x = x + o @ L["wo"]
        h = F.rms_norm(x, (x.shape[-1],), L["ln2"], eps)
        p = torch.softmax(h @ L["wr"], -1)
        w, idx = torch.topk(p, k, -1)
        if P["norm_topk"]:
            w = w / w.sum(-1, keepdim=True)
        if W == 1:                                               # the row's k experts, gathered
            gu = torch.bmm(h.expand(k, 1, -1), L["gu"][idx[0]])
            g, u = gu.split(inter, -1)
            x = x + (torch.bmm(F.silu(g) * u, L["dn"][idx[0]]) * w[0][:, None, None]).sum(0)
        else:                                                    # every expert on every row, weighted
            E = L["gu"].shape[0]
            gu = torch.bmm(h.expand(E, W, -1), L["gu"])
            g, u = gu.split(inter, -1)
            y = torch.bmm(F.silu(g) * u, L["dn"])                     # [E, W, H]
            dense_w = torch.zeros(W, E).scatter(1, idx, w)            # [W, E]
            x = x + torch.einsum("ewh,we->wh", y, dense_w)
    return F.rms_norm(x, (x.shape[-1],), P["norm"], eps) @ P["head"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,5")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--task", default="code")
    ap.add_argument("--shipped", action="store_true", help="also the shipped step through torch.compile as it is")
    args = ap.parse_args(argv)
    from runtime.engine import Engine
    from runtime.gpu import static_step as ss

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "threads": torch.get_num_threads(),
                           "torch": torch.__version__, "rows": []}
    table = []
    with torch.no_grad():
        eng = Engine.build(NANO, "none", device="cpu", context=4096)
        ids = eng.tokenizer.encode(task_prompts()[args.task]).ids
        eng.generate(ids, draft=False, max_new_tokens=1, stop_ids=set(), width=1)     # prefill into eng.kv
        kv, start = eng.kv, eng.kv.length
        P = weights(eng.model)
        kcs = [kv.layer(i).kernel_args()[0].float().clone() for i in range(len(P["layers"]))]
        vcs = [kv.layer(i).kernel_args()[1].float().clone() for i in range(len(P["layers"]))]
        # the weights and caches as the closure's constants (as arguments, Dynamo would guard every tensor of
        # them on every call), the start position a dynamic int
        compiled = torch.compile(lambda win, st: plain_step(P, win, st, kcs, vcs), dynamic=True)
        for width in [int(w) for w in args.widths.split(",") if w]:
            step = ss.StaticStep(eng.model, kv, width, graph=False)
            window = torch.tensor([ids[-width:]])
            win = window[0]
            st = start

            def shipped(step=step, window=window):
                kv.length = start
                return step(window, kv).logits[0]

            def plain(win=win, st=st):
                return plain_step(P, win, st, kcs, vcs)

            def comp(win=win, st=st):
                return compiled(win, st)
            ref = shipped().float().clone()
            eager_logits = plain()
            t0 = time.time()
            got = comp()
            comp(win, st + 1)                  # a second length: the dynamic shape is in the graph
            compile_s = time.time() - t0
            fns = [("shipped", shipped), ("plain", plain), ("compiled", comp)]
            if args.shipped:
                step_c = ss.StaticStep(eng.model, kv, width, graph=False)
                step_c._forward_plan = torch.compile(step_c._forward_plan, dynamic=True)
                fns.append(("shipped_compiled", lambda step=step_c, window=window: (
                    setattr(kv, "length", start), step(window, kv).logits[0])[1]))
                fns[-1][1]()
            times: dict[str, list[float]] = {name: [] for name, _ in fns}
            for _ in range(args.rounds):
                for name, fn in fns:
                    c0 = time.process_time()
                    for _ in range(args.steps):
                        fn()
                    times[name].append((time.process_time() - c0) / args.steps * 1e3)
            row = {"width": width, "context": start, "compile_s": compile_s,
                   **{f"{k}_ms": median(v) for k, v in times.items()},
                   "plain_vs_shipped_max_abs": float((eager_logits - ref).abs().max()),
                   "compiled_vs_shipped_max_abs": float((got - ref).abs().max()),
                   "compiled_top1_same": bool((got.argmax(-1) == ref.argmax(-1)).all())}
            res["rows"].append(row)
            table.append([width, start, f"{row['shipped_ms']:.3f}",
                          f"{row['shipped_compiled_ms']:.3f}" if args.shipped else "-", f"{row['plain_ms']:.3f}",
                          f"{row['compiled_ms']:.3f}", f"{row['shipped_ms'] / row['compiled_ms']:.2f}x",
                          f"{compile_s:.0f}", f"{row['compiled_vs_shipped_max_abs']:.1e}", row["compiled_top1_same"]])
            print(f"  W={width}: shipped {row['shipped_ms']:.3f} ms, plain {row['plain_ms']:.3f}, compiled "
                  f"{row['compiled_ms']:.3f}", flush=True)
    print_table(f"CPU step on the bundled pack, {args.task} prompt ({start} tokens), ms per step (process time, median "
                f"of {args.rounds} interleaved rounds, {torch.get_num_threads()} thread(s))",
                ["W", "context", "shipped", "shipped compiled", "plain eager", "plain compiled", "shipped / compiled", "compile s",
                 "max |dlogit|", "top-1 same"], table)
    write_json("cpu_compile.json", res)
    return res


if __name__ == "__main__":
    main()
