"""What each stage of the decode step costs inside the CUDA graph: the step without that stage's launches.

    python bench/step_ablate.py [--contexts 1024,16384] [--widths 1] [--quant q4_0] [--rounds 7] [--steps 30]

The kernel profile (bench/step_profile.py) times kernels run eagerly, where a kernel launched with PDL starts early
and waits, so its time overlaps its neighbours' and the sum says little about the graph. Here each arm captures the
engine's one-row step (runtime/gpu/static_step.py, every layer through `fused_layer`) with one stage taken out: its
function returns a buffer of the right shape made during the warm-up (no launch inside the graph), so the graph
holds every other launch as it is. The step time saved is what that stage adds to the critical path (its launches,
the latency of its loads, its arithmetic, its bytes), per layer next to what its bytes take at the measured copy
bandwidth. The outputs are wrong by design (a stage's result is a constant): timing only.

With --widths 2-16 the same for verify windows (there the norms have launches of their own and stay; a stage's
bytes are quoted for one row only, as the experts a window reads depend on its rows' routing; no route arm: the
warm-up's rows, often all alike, would route the whole window to a few experts).
Stages: qkv (the norm + q/k/v product), post (q/k norm, RoPE, the K/V write), attention (split + reduction),
o_proj, router (the norm + router product), route (the top-k kernel; a routing made at the warm-up is reused, of a
real row: the warm-up's row may be padding, whose routing has no expert, which would drop the experts' work too),
experts (gate/up, down, top-k sum + residual), and the attention block (post + attention) together; route-relay is
not an ablation: the routing kernel, then a one-program kernel that copies its tables for the experts to read (what
one more launch in that place costs).
A3B shape, honest routing (bench/common.py), BF16 and with --quant a block-format build (bench/quant_target.py).
Arms run interleaved (rounds of `steps` replays over every arm), medians quoted. Writes `step_ablate.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, machine, median, print_table, write_json  # noqa: E402

STAGES = ("qkv", "post", "attention", "post+attention", "o_proj", "router", "route", "route-relay", "experts")

from runtime.gpu import pdl  # noqa: E402
from runtime.gpu.kernels import HAVE_TRITON  # noqa: E402

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _relay_kernel(i_ptr, w_ptr, s_ptr, o_ptr, t_ptr, dst_ptr, K, KP: tl.constexpr, GDC: tl.constexpr = False):
        """One program that waits for the routing kernel and copies its five tables (K entries each) into dst."""
        pdl.start(GDC)
        j = tl.arange(0, KP)
        m = j < K
        tl.store(dst_ptr + j, tl.load(i_ptr + j, mask=m), mask=m)
        tl.store(dst_ptr + K + j, tl.load(w_ptr + j, mask=m).to(tl.int32, bitcast=True), mask=m)
        tl.store(dst_ptr + 2 * K + j, tl.load(s_ptr + j, mask=m), mask=m)
        tl.store(dst_ptr + 3 * K + j, tl.load(o_ptr + j, mask=m), mask=m)
        tl.store(dst_ptr + 4 * K + j, tl.load(t_ptr + j, mask=m), mask=m)


class Consts:
    """Buffers that stand for a stage's output: made on the first (eager) call, returned as they are after."""

    def __init__(self) -> None:
        self.made: dict[tuple, Any] = {}

    def like(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        k = (key, tuple(shape), dtype, device)
        if k not in self.made:
            self.made[k] = torch.randn(shape, device=device).to(dtype) * 0.01
        return self.made[k]

    def keep(self, key: tuple, make) -> Any:
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]


@contextlib.contextmanager
def ablate(stage: str, consts: Consts):
    """The step's functions with `stage` (or stages joined by '+') replaced by constants, restored after."""
    from runtime.gpu import attention_kernels, dense_kernels, moe_kernels, static_step

    parts = set(stage.split("+")) if stage else set()
    saved = {(attention_kernels, "qkv_post"): attention_kernels.qkv_post,
             (attention_kernels, "attention"): attention_kernels.attention,
             (dense_kernels, "norm_one_row"): dense_kernels.norm_one_row,
             (dense_kernels, "quant_norm_one_row"): dense_kernels.quant_norm_one_row,
             (static_step, "_proj"): static_step._proj,
             (moe_kernels, "route"): moe_kernels.route,
             (moe_kernels, "moe_routed"): moe_kernels.moe_routed}
    real = {name: fn for (_, name), fn in saved.items()}

    def norm_one_row(x, delta, norm_w, eps, w, role):
        if role == "qkv" and "qkv" in parts and w is not None:
            return x, None, consts.like("qkv", (x.shape[0], w.shape[0]), x.dtype, x.device)
        if role == "router" and "router" in parts and w is not None:
            return x, x, consts.like("router", (x.shape[0], w.shape[0]), x.dtype, x.device)
        return real["norm_one_row"](x, delta, norm_w, eps, w, role)

    def quant_norm_one_row(x, norm_w, eps, mod, role):
        if role == "qkv" and "qkv" in parts:
            return consts.like("qkv", (x.shape[0], mod.out_features), x.dtype, x.device)
        return real["quant_norm_one_row"](x, norm_w, eps, mod, role)

    def qkv_post(qkv, q_w, k_w, inv, rscale, pos, kc, vc, nh, nkv, hd, eps, **kw):
        if "post" in parts:
            return consts.like("q", (qkv.shape[0], nh, hd), qkv.dtype, qkv.device)
        return real["qkv_post"](qkv, q_w, k_w, inv, rscale, pos, kc, vc, nh, nkv, hd, eps, **kw)

    def attention(q, kc, vc, pos, scale, **kw):
        if "attention" in parts:
            return consts.like("o", tuple(q.shape), q.dtype, q.device)
        return real["attention"](q, kc, vc, pos, scale, **kw)

    def proj(x, w, role, usual, blocks=None):
        if role in ("o_proj", "qkv") and role in parts:
            out = w.shape[0] if w is not None else blocks.out_features
            return consts.like(role, (x.shape[0], out), x.dtype, x.device)
        if role == "router" and "router" in parts:
            out = w.shape[0] if w is not None else usual.out_features
            return consts.like("router", (x.shape[0], out), x.dtype, x.device)
        return real["_proj"](x, w, role, usual, blocks)

    def route(logits, pos, top_k, norm, slot=None):
        if "route-relay" in parts:      # the routing kernel, then a one-program copy of its tables the experts read
            r = real["route"](logits, pos, top_k, norm, slot=slot)
            k = r.idx.numel()
            dst = torch.empty(5 * k, dtype=torch.int32, device=logits.device)
            _relay_kernel[(1,)](r.idx, r.w, r.se, r.order, r.tok, dst, k, KP=triton.next_power_of_2(k),
                                **pdl.launch(dst, "route"))
            return r._replace(idx=dst[:k].view(r.idx.shape), w=dst[k:2 * k].view(torch.float32).view(r.w.shape),
                              se=dst[2 * k:3 * k], order=dst[3 * k:4 * k], tok=dst[4 * k:5 * k])
        if "route" in parts:
            # made at the warm-up, whose row may be a padded one (pos < 0, no expert): routed as a real row
            return consts.keep(("route", tuple(logits.shape), top_k, norm),
                               lambda: real["route"](logits, torch.zeros_like(pos), top_k, norm, slot=slot))
        return real["route"](logits, pos, top_k, norm, slot=slot)

    def moe_routed(x, residual, r, gate_up, down, **kw):
        if "experts" in parts and residual is not None:
            return residual
        return real["moe_routed"](x, residual, r, gate_up, down, **kw)

    repl = {"qkv_post": qkv_post, "attention": attention, "norm_one_row": norm_one_row,
            "quant_norm_one_row": quant_norm_one_row, "_proj": proj, "route": route, "moe_routed": moe_routed}
    try:
        for (mod, name) in saved:
            setattr(mod, name, repl[name])
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def stage_bytes(model) -> dict[str, float]:
    """Bytes one layer's stage reads from weights (the step's own format), for a one-row window."""
    layer = model.model.layers[0]
    a, mlp = layer.self_attn, layer.mlp

    def nbytes(mod) -> int:
        for name in ("blocks", "weight"):
            t = getattr(mod, name, None)
            if isinstance(t, torch.Tensor):
                return t.numel() * t.element_size()
        return 0

    qkv = (a.qkv_weight.numel() * a.qkv_weight.element_size() if a.qkv_weight is not None
           else nbytes(a.qkv_blocks))
    k = mlp.top_k
    experts = k * (mlp.gate_up[0].numel() * mlp.gate_up.element_size() + mlp.down[0].numel() * mlp.down.element_size())
    return {"qkv": qkv, "o_proj": nbytes(a.o_proj), "router": nbytes(mlp.gate), "experts": experts}


def run(model, tag: str, contexts: list[int], widths: list[int], stages: list[str], rounds: int, steps: int,
        bw: float) -> list[dict[str, Any]]:
    from bench.context import make_kv
    from bench.step_ab import interleaved_times
    from runtime.gpu.static_step import StaticStep

    consts = Consts()
    n_layers = model.cfg.num_hidden_layers
    kvs = {c: make_kv(model, c, "bf16", capacity=c + 64) for c in contexts}
    wins = {w: torch.randint(0, model.cfg.vocab_size, (1, w), device="cuda") for w in widths}
    arms = ["none", *stages]
    built: dict[tuple[str, int, int], Any] = {}
    errors: dict[tuple[str, int, int], list[str]] = {}
    for a in arms:
        for c in contexts:
            for w in widths:
                if a == "route" and w > 1:      # the warm-up's rows are not the timed window's (often all alike):
                    continue                    # its routing would touch fewer experts than the window's
                with ablate("" if a == "none" else a, consts):
                    st = StaticStep(model, kvs[c], w, graph=True)
                    for _ in range(2):          # capture (after the warm-up made the constants), then one replay
                        st(wins[w], kvs[c])
                        kvs[c].rollback(c)
                built[(a, c, w)] = st
                errors[(a, c, w)] = list(st.errors)
    times = interleaved_times(built, kvs, wins, rounds, steps)
    sb = stage_bytes(model)
    rows = []
    for c in contexts:
        for w in widths:
            base = median(times[("none", c, w)])
            for a in (a for a in arms if (a, c, w) in times):
                ms = median(times[(a, c, w)])
                # bytes of a one-row window (a wider one reads more experts: the distinct ones of its rows)
                nb = sum(sb.get(p, 0) for p in a.split("+")) if w == 1 or "experts" not in a else 0
                rows.append({"build": tag, "stage": a, "context": c, "width": w, "step_ms": ms,
                             "rounds_ms": times[(a, c, w)],
                             "saved_us_per_layer": (base - ms) * 1e3 / n_layers if a != "none" else 0.0,
                             "bytes_per_layer": nb, "bytes_us_per_layer": nb / bw * 1e6,
                             "graph": built[(a, c, w)].use_graph, "errors": errors[(a, c, w)]})
    for st in built.values():
        st.graphs.clear()
    del built, kvs
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--widths", default="1", help="window rows of the step (verify windows: 2-16)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--quant", default="", help="also a block-format build (q4_0, q8_0)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/step_ablate.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    from bench.context import build_a3b

    contexts = [int(x) for x in args.contexts.split(",") if x]
    widths = [int(x) for x in args.widths.split(",") if x]
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if not set(s.split("+")) <= set("+".join(STAGES).split("+"))]
    if unknown:
        print(f"unknown stages {unknown}; use some of {', '.join(STAGES)} (joined by '+').", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    res: dict[str, Any] = {"machine": machine(), "copy_GBs": bw / 1e9, "rows": []}
    model, _ = build_a3b()
    res["rows"] += run(model, "bf16", contexts, widths, stages, args.rounds, args.steps, bw)
    del model
    torch.cuda.empty_cache()
    for q in (x for x in args.quant.split(",") if x):
        from bench.common import A3B_SHAPE
        from bench.quant_target import build_on_gpu

        qm = build_on_gpu(A3B_SHAPE, q)
        res["rows"] += run(qm, q, contexts, widths, stages, args.rounds, args.steps, bw)
        del qm
        torch.cuda.empty_cache()
    write_json("step_ablate.json", res)
    print_table(f"Decode step without each stage, {res['machine'].get('gpu')}, copy {bw / 1e9:,.0f} GB/s (median of "
                f"{args.rounds} rounds of {args.steps} replays)",
                ["build", "context", "W", "without", "step ms", "saved us/layer", "its bytes us/layer", "errors"],
                [[r["build"], r["context"], r["width"], r["stage"], r["step_ms"], r["saved_us_per_layer"],
                  r["bytes_us_per_layer"] if r["bytes_per_layer"] else None, "; ".join(r["errors"])[:40]]
                 for r in res["rows"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
