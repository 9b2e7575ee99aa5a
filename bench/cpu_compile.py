"""What torch.compile (inductor's C++ code) could do for the CPU step, on the bundled pack: the shipped step and MTP
chain against the same model written as plain tensor ops, eager and compiled, side by side in one process.

    OMP_NUM_THREADS=1 python bench/cpu_compile.py [--widths 1,4,5] [--block 4] [--rounds 6] [--steps 30] [--shipped]

The CPU step is paid per op (docs/models.md, "Numerics"), and inductor fuses element-wise ops and runs a graph
without the interpreter and the dispatcher between them. The shipped step does not compile as it is (its routed
experts are Python calls per expert id, so Dynamo breaks the graph and recompiles per id: `--shipped` adds a column
with `StaticStep._forward_plan` itself through `torch.compile`), so this script writes the pack's step in a form
that compiles whole: every op on tensors, the row's experts gathered by index (one row) or every expert on every
row weighted by the routing (a window, as `SparseMoe.dense` does), the cache only read (the window's K/V returned
and written outside the graph: `_layer`), the start position a dynamic int. Reported per width: ms per step
(process time, median of interleaved rounds) of the shipped step, the plain form eager and compiled, the compile
time, and the compiled logits against the shipped ones (max |difference|, top-1 agreement). Then the MTP head's
chain of block - 1 drafts (the shipped drafter's `propose` against `mtp_chain` compiled), the tokens a window
commits in the engine's own run on the prompt (and its speed against the target alone in one-row steps), and the
window cost (a block-row verify + the chain) and speedup each way would give. A measurement of what a compiled
step could give, not a runtime path: a compiled step's bits depend on inductor's code, so the lossless promise (a
row's bits the same at every width) would need checking before any use. Writes `cpu_compile.json`.
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


def layer_weights(layer) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors as plain [in, out] matrices (fp32 copies)."""
    a, m = layer.self_attn, layer.mlp
    wqkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).float().t().contiguous()
    gu = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)).float().t() for e in m.experts])
    dn = torch.stack([e.down_proj.weight.float().t() for e in m.experts])
    return dict(ln1=layer.input_layernorm.weight.float(), ln2=layer.post_attention_layernorm.weight.float(),
                wqkv=wqkv, qn=a.q_norm.weight.float(), kn=a.k_norm.weight.float(),
                wo=a.o_proj.weight.float().t().contiguous(), wr=m.gate.weight.float().t().contiguous(),
                gu=gu.contiguous(), dn=dn.contiguous())


def weights(model) -> dict[str, Any]:
    """The pack's tensors (target and MTP head) as plain [in, out] matrices (fp32 copies: the steps below own them)."""
    from runtime.models.layers import rope_inv_freq

    cfg = model.cfg
    inv, scale = rope_inv_freq(cfg)
    P = dict(layers=[layer_weights(la) for la in model.model.layers], emb=model.model.embed_tokens.weight.float(),
             norm=model.model.norm.weight.float(), head=model.lm_head.weight.float().t().contiguous(), inv=inv,
             rscale=scale, eps=cfg.rms_norm_eps, nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads,
             hd=cfg.head_dim, k=cfg.num_experts_per_tok, inter=cfg.moe_intermediate_size,
             norm_topk=cfg.norm_topk_prob, mtp=None)
    if model.mtp is not None:
        mt = model.mtp
        from runtime.drafters import head8

        P["mtp"] = dict(layer=layer_weights(mt.layers[0]), ne=mt.pre_fc_norm_embedding.weight.float(),
                        ng=mt.pre_fc_norm_hidden.weight.float(), fc=mt.fc.weight.float().t().contiguous(),
                        norm=mt.norm.weight.float(), head8=head8.int8_head(model.lm_head))
    return P


def _layer(P: dict[str, Any], L: dict[str, torch.Tensor], x: torch.Tensor, pos: torch.Tensor, start, kc, vc,
           ek: torch.Tensor | None = None, ev: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer on rows x [W, H] at positions pos, attending to the cache's slots 0..start-1 (kc/vc [nkv, S,
    hd], only read), then to ek/ev [nkv, m, hd] (entries not in the cache: an MTP chain's earlier steps), then to
    the rows themselves, causally. Returns (x, the rows' K and V [nkv, W, hd]) for the caller to write at slots
    start + m..: a graph that wrote them into the cache itself would copy the whole cache a write (a mutated
    input is functionalized), and the scores and values go in two parts so the cached keys are never copied."""
    nh, nkv, hd, eps = P["nh"], P["nkv"], P["hd"], P["eps"]
    W = x.shape[0]
    grp = nh // nkv
    f = pos[:, None].float() * P["inv"][None, :]
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos() * P["rscale"], emb.sin() * P["rscale"]   # [W, hd]

    def rope(t):                                                  # [W, heads, hd]
        h = hd // 2
        return t * cos[:, None] + torch.cat((-t[..., h:], t[..., :h]), -1) * sin[:, None]
    h = F.rms_norm(x, (x.shape[-1],), L["ln1"], eps)
    q, kk, v = (h @ L["wqkv"]).split((nh * hd, nkv * hd, nkv * hd), -1)
    q = rope(F.rms_norm(q.view(W, nh, hd), (hd,), L["qn"], eps))
    kt = rope(F.rms_norm(kk.view(W, nkv, hd), (hd,), L["kn"], eps)).transpose(0, 1)      # [nkv, W, hd]
    vt = v.view(W, nkv, hd).transpose(0, 1)
    kn, vn = (kt, vt) if ek is None else (torch.cat((ek, kt), 1), torch.cat((ev, vt), 1))
    m = kn.shape[1] - W
    qg = q.view(W, nkv, grp, hd).permute(1, 0, 2, 3).reshape(nkv, W * grp, hd) * hd ** -0.5
    s_old = torch.bmm(qg, kc[:, :start].transpose(1, 2))                     # [nkv, W*g, start]
    s_new = torch.bmm(qg, kn.transpose(1, 2)).view(nkv, W, grp, m + W)
    causal = torch.arange(m + W)[None, :] <= (m + torch.arange(W))[:, None]  # [W, m + W]
    s_new = s_new.masked_fill(~causal[None, :, None, :], float("-inf")).view(nkv, W * grp, m + W)
    p = torch.softmax(torch.cat((s_old, s_new), -1), -1)
    o = torch.bmm(p[..., :start], vc[:, :start]) + torch.bmm(p[..., start:], vn)
    o = o.view(nkv, W, grp, hd).permute(1, 0, 2, 3).reshape(W, nh * hd)
    return moe_half(P, L, x + o @ L["wo"]), kt, vt


def moe_half(P: dict[str, Any], L: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x [W, H] + the layer's routed experts of its post-attention norm: one row's k experts gathered, or every
    expert on every row weighted by the routing (a window, as `SparseMoe.dense` does)."""
    W, k, inter = x.shape[0], P["k"], P["inter"]
    h = F.rms_norm(x, (x.shape[-1],), L["ln2"], P["eps"])
    w, idx = torch.topk(torch.softmax(h @ L["wr"], -1), k, -1)
    if P["norm_topk"]:
        w = w / w.sum(-1, keepdim=True)
    if W == 1:                                               # the row's k experts, gathered
        gu = torch.bmm(h.expand(k, 1, -1), L["gu"][idx[0]])
        g, u = gu.split(inter, -1)
        return x + (torch.bmm(F.silu(g) * u, L["dn"][idx[0]]) * w[0][:, None, None]).sum(0)
    E = L["gu"].shape[0]                                     # every expert on every row, weighted
    gu = torch.bmm(h.expand(E, W, -1), L["gu"])
    g, u = gu.split(inter, -1)
    y = torch.bmm(F.silu(g) * u, L["dn"])                         # [E, W, H]
    return x + torch.einsum("ewh,we->wh", y, torch.zeros(W, E).scatter(1, idx, w))


def float_caches(kv, layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 copies of each layer's K and V cache [nkv, S, hd] (what the plain step reads and writes)."""
    return ([kv.layer(i).kernel_args()[0].float().clone() for i in range(layers)],
            [kv.layer(i).kernel_args()[1].float().clone() for i in range(layers)])


def plain_forward(P: dict[str, Any], ids: torch.Tensor, start: int, kcs: list, vcs: list
                  ) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """(logits [W, V], hidden after the final norm [W, H], each layer's new K and V [nkv, W, hd]) of the window ids
    [W] at positions start.. (the caches read up to start; `write` puts the new entries in)."""
    pos = start + torch.arange(ids.shape[0])
    x = P["emb"][ids]
    ks, vs = [], []
    for i, L in enumerate(P["layers"]):
        x, kt, vt = _layer(P, L, x, pos, start, kcs[i], vcs[i])
        ks.append(kt)
        vs.append(vt)
    hid = F.rms_norm(x, (x.shape[-1],), P["norm"], P["eps"])
    return hid @ P["head"], hid, ks, vs


def write(kcs: list, vcs: list, ks: list, vs: list, start: int) -> None:
    """The window's K/V into the caches at slots start.. (eager, outside any compiled graph)."""
    for kc, vc, kt, vt in zip(kcs, vcs, ks, vs, strict=True):
        kc[:, start:start + kt.shape[1]] = kt
        vc[:, start:start + vt.shape[1]] = vt


def plain_step(P: dict[str, Any], ids: torch.Tensor, start: int, kcs: list, vcs: list, fwd=None) -> torch.Tensor:
    """Logits of the window ids [W] at positions start.., its K/V written into kcs/vcs [nkv, S, hd] (fwd: a compiled
    `plain_forward`)."""
    logits, _, ks, vs = (fwd or plain_forward)(P, ids, start, kcs, vcs)
    write(kcs, vcs, ks, vs, start)
    return logits


def mtp_chain(P: dict[str, Any], anchor: torch.Tensor, g: torch.Tensor, pos: int, n: int, kc, vc
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n greedy draft tokens from the MTP head, as `MTPDrafter.propose` chains them on a CPU: step i at position
    pos + i (cache slot pos + i - 1) from (token, g), the first from (anchor, the target's hidden at pos - 1), each
    next from the token drafted and the step's own output after `mtp.norm`; the vocabulary product through the
    int8 head where the shipped chain uses it (runtime/drafters/head8.py). Returns (drafts, the first step's K and V:
    the entry a window keeps, for the caller to write at slot pos - 1; the later steps' entries are dropped)."""
    M, eps = P["mtp"], P["eps"]
    tok, toks = anchor, []
    ek = ev = None
    for i in range(n):
        e = F.rms_norm(P["emb"][tok], (g.shape[-1],), M["ne"], eps)
        x = torch.cat((e, F.rms_norm(g, (g.shape[-1],), M["ng"], eps)), -1) @ M["fc"]
        x, kt, vt = _layer(P, M["layer"], x, torch.full((1,), pos + i), pos - 1, kc, vc, ek, ev)
        ek, ev = (kt, vt) if ek is None else (torch.cat((ek, kt), 1), torch.cat((ev, vt), 1))
        g = F.rms_norm(x, (x.shape[-1],), M["norm"], eps)
        if M["head8"] is not None:       # the vocabulary product in 8 bits, as the shipped chain runs it
            tok = torch._weight_int8pack_mm(g.to(torch.bfloat16), *M["head8"]).argmax(-1)
        else:
            tok = (g @ P["head"]).argmax(-1)
        toks.append(tok)
    return torch.cat(toks), ek[:, :1], ev[:, :1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,4,5", help="step widths; the MTP projection needs 1 and --block")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--task", default="code")
    ap.add_argument("--shipped", action="store_true", help="also the shipped step through torch.compile as it is")
    ap.add_argument("--block", type=int, default=4, help="the MTP window: block - 1 drafts, a block-row verify")
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    from runtime.engine import Engine
    from runtime.gpu import static_step as ss

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "threads": torch.get_num_threads(),
                           "torch": torch.__version__, "rows": []}
    table = []
    with torch.no_grad():
        eng = Engine.build(NANO, "mtp", device="cpu", context=4096, block=args.block)    # the head's weights too
        ids = eng.tokenizer.encode(task_prompts()[args.task]).ids
        eng.generate(ids, draft=False, max_new_tokens=1, stop_ids=set(), width=1)     # prefill into eng.kv
        kv, start = eng.kv, eng.kv.length
        P = weights(eng.model)
        kcs, vcs = float_caches(kv, len(P["layers"]))
        # the weights and caches as the closure's constants (as arguments, Dynamo would guard every tensor of
        # them on every call), the start position a dynamic int
        compiled = torch.compile(lambda win, st: plain_forward(P, win, st, kcs, vcs), dynamic=True)
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
                return plain_step(P, win, st, kcs, vcs, lambda *a: compiled(a[1], a[2]))
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
        res["row_invariance"] = row_invariance(P, ids, start, kcs, vcs, compiled, eng, kv, ss, max(
            int(w) for w in args.widths.split(",") if w))
        if P["mtp"] is not None:
            res["mtp"] = mtp_part(P, ids, args, res["rows"])
    print_table(f"CPU step on the bundled pack, {args.task} prompt ({start} tokens), ms per step (process time, median "
                f"of {args.rounds} interleaved rounds, {torch.get_num_threads()} thread(s))",
                ["W", "context", "shipped", "shipped compiled", "plain eager", "plain compiled", "shipped / compiled", "compile s",
                 "max |dlogit|", "top-1 same"], table)
    write_json("cpu_compile.json", res)
    return res


def row_invariance(P: dict[str, Any], ids: list[int], start: int, kcs: list, vcs: list, compiled, eng, kv, ss,
                   width: int) -> dict[str, Any]:
    """The CPU promise a compiled step would have to keep at a fixed width: a row's bits do not depend on the rows
    after it in the window. The last `width` prompt tokens as a window at `start`, against the same window with
    every row after the first changed: per form (shipped step, plain eager, plain compiled), whether the first
    row's logits are bit-equal both ways, and their largest difference. (Across widths none of the forms gives the
    same bits, the shipped step included: the engine keeps one width for a run.)"""
    win = torch.tensor(ids[-width:])
    other = win.clone()
    other[1:] = (other[1:] + 1) % P["emb"].shape[0]
    k0 = [k.clone() for k in kcs]
    v0 = [v.clone() for v in vcs]
    out: dict[str, Any] = {"width": width}

    def restore():
        for a, b in zip(kcs, k0, strict=True):
            a.copy_(b)
        for a, b in zip(vcs, v0, strict=True):
            a.copy_(b)

    def record(name, a, b):
        out[name] = {"bit_equal": bool(torch.equal(a, b)), "max_abs": float((a - b).abs().max())}
    for name, fwd in {"plain_eager": None, "plain_compiled": lambda *a: compiled(a[1], a[2])}.items():
        restore()
        first = plain_step(P, win, start, kcs, vcs, fwd)[0]
        restore()
        record(name, first, plain_step(P, other, start, kcs, vcs, fwd)[0])
    restore()
    step = ss.StaticStep(eng.model, kv, width, graph=False)
    kv.length = start
    first = step(win[None], kv).logits[0, 0].float().clone()
    kv.length = start
    record("shipped", first, step(other[None], kv).logits[0, 0].float())
    kv.length = start
    print_table(f"The first row of a {width}-row window with the rows after it changed (its logits)",
                ["form", "bit-equal", "max |difference|"],
                [[k, v["bit_equal"], f"{v['max_abs']:.1e}"] for k, v in out.items() if k != "width"])
    return out


def mtp_part(P: dict[str, Any], ids: list[int], args: argparse.Namespace, rows: list[dict[str, Any]]
             ) -> dict[str, Any]:
    """The MTP head's chain of block - 1 drafts, the shipped drafter's `propose` against `mtp_chain` compiled, and
    what a window would cost with each: the engine's own run gives the tokens a window commits on this prompt."""
    from runtime.engine import Engine

    B, n = args.block, args.block - 1
    eng = Engine.build(NANO, "mtp", device="cpu", context=4096, block=B)      # its own caches
    spec = eng.generate(ids, max_new_tokens=args.new_tokens, stop_ids=set())
    # the target alone in one-row steps (an engine with a drafter would run its `block`-wide step for it too)
    alone = eng.generate(ids, max_new_tokens=args.new_tokens, stop_ids=set(), draft=False, width=1)
    per_window = 1 + sum(spec.stats["accepted_per_window"]) / max(1, spec.stats["windows"])
    first = eng.generate(ids, max_new_tokens=1, stop_ids=set())        # prompt observed: draft at len(ids)
    dr, pos, anchor = eng.drafter, len(ids), first.token_ids[-1]

    def shipped():
        dr.kv.length = pos - 1
        return dr.propose(anchor, pos, n).tokens
    ref = shipped()
    kc, vc = dr.kv.k[0, 0].float().clone(), dr.kv.v[0, 0].float().clone()
    g = dr.last_g[None].float()
    a = torch.tensor([anchor])
    chain_c = torch.compile(lambda a, g, p: mtp_chain(P, a, g, p, n, kc, vc), dynamic=True)

    def chain(a, g, p):
        toks, k0, v0 = chain_c(a, g, p)
        kc[:, p - 1:p] = k0                  # the kept entry (anchor, g[pos - 1]), as the shipped chain keeps it
        vc[:, p - 1:p] = v0
        return toks
    t0 = time.time()
    got = chain(a, g, pos)
    compile_s = time.time() - t0
    ts: dict[str, list[float]] = {"shipped": [], "compiled": []}
    for _ in range(args.rounds):
        for name, fn in (("shipped", shipped), ("compiled", lambda: chain(a, g, pos))):
            c0 = time.process_time()
            for _ in range(args.steps):
                fn()
            ts[name].append((time.process_time() - c0) / args.steps * 1e3)
    chain_ms = {k: median(v) for k, v in ts.items()}
    one = next((r for r in rows if r["width"] == 1), None)
    wide = next((r for r in rows if r["width"] == B), None)
    out: dict[str, Any] = {"block": B, "drafts": n, "tokens_per_window": per_window,
                           "engine_spec_tok_s": spec.stats["decode_tok_s"],
                           "engine_alone_tok_s": alone.stats["decode_tok_s"],
                           "engine_speedup": spec.stats["decode_tok_s"] / alone.stats["decode_tok_s"],
                           "chain_shipped_ms": chain_ms["shipped"], "chain_compiled_ms": chain_ms["compiled"],
                           "chain_compile_s": compile_s, "drafts_same": bool(torch.equal(got, ref))}
    if one and wide:      # a window = a verify of B rows + the chain; the target alone = one-row steps
        for side in ("shipped", "compiled"):
            key = "shipped_ms" if side == "shipped" else "compiled_ms"
            win = wide[key] + chain_ms[side]
            out[f"{side}_window_ms"] = win
            out[f"{side}_projected_speedup"] = per_window * one[key] / win
    print_table(f"MTP block {B} on the {args.task} prompt: {per_window:.2f} tokens a window (the engine: "
                f"{out['engine_speedup']:.2f}x the target alone); the chain of {n} drafts, ms",
                ["chain shipped", "chain compiled", "compile s", "same drafts", "window shipped (verify + chain)",
                 "window compiled", "projected speedup shipped", "projected speedup compiled"],
                [[f"{chain_ms['shipped']:.3f}", f"{chain_ms['compiled']:.3f}", f"{compile_s:.0f}", out["drafts_same"],
                  f"{out.get('shipped_window_ms', float('nan')):.3f}", f"{out.get('compiled_window_ms', float('nan')):.3f}",
                  f"{out.get('shipped_projected_speedup', float('nan')):.2f}x",
                  f"{out.get('compiled_projected_speedup', float('nan')):.2f}x"]])
    return out


if __name__ == "__main__":
    main()
