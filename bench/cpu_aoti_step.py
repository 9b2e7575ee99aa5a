"""What an ahead-of-time compiled *target* step could do on a CPU, and whether it could keep the lossless promise: the
pack's step written as plain tensor ops (bench/cpu_compile.py's `plain_forward`), exported and compiled by
AOTInductor at a fixed width, against the shipped step, on the bundled pack.

    OMP_NUM_THREADS=1 python bench/cpu_aoti_step.py [--widths 1,4] [--rounds 8] [--steps 40]

Per width: ms per step (process time, median of interleaved rounds) of the shipped step and of the compiled one
(the cache goes in as views of slots 0..start-1 and the window's K/V come back for the caller to write, as in
runtime/drafters/mtp_compiled.py; the weights are constants of the package here), the compile time, and the
logits against the shipped step's. Then the promise a runtime path would have to keep at a fixed width W (the
engine runs one width a run: target-only windows are one real row and W - 1 padding rows):
- pad: a row's logits are the same bits whatever the rows after it hold (the window's real rows against padding);
- position: row j of a window starting at s has the bits of row 0 of a window starting at s + j, the rows before
  it already in the cache (the same token at the same position, in another window position and context length).
A measurement, not a runtime path. Writes `cpu_aoti_step.json`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, machine, median, print_table, task_prompts, write_json  # noqa: E402
from bench.cpu_compile import float_caches, moe_half, plain_forward, weights, write  # noqa: E402


class _Step(torch.nn.Module):
    """plain_forward with the start taken from the cache views' length (a dynamic size) and the weights held."""

    def __init__(self, P: dict[str, Any]) -> None:
        super().__init__()
        self.P = P

    def forward(self, ids: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]):
        start = ks[0].shape[1]
        logits, _, k_new, v_new = plain_forward(self.P, ids, start, ks, vs)
        return logits, k_new, v_new


CHUNK = 128          # values summed in chunks fixed by position (the shipped step: 512; any fixed size keeps the bits)


class _ChunkedStep(torch.nn.Module):
    """The step with the shipped step's attention structure (`StaticStep._attend_window`): the window's K/V written
    into the whole cache in place first (AOTInductor writes a mutated input in place, no copy), then every row's
    scores against keys 0..N-1 (N: the window's end rounded up to CHUNK), the keys past a row's position masked
    (a padded row, position -1, sees key 0 only), one softmax, and the values in CHUNK-position chunks summed in
    chunk order. The start is the length of `st` and the chunk count the length of `ch` (views of a buffer: sizes
    export keeps symbolic), the rows' positions come in as `pos`."""

    def __init__(self, P: dict[str, Any]) -> None:
        super().__init__()
        self.P = P

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, st: torch.Tensor, ch: torch.Tensor,
                ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F

        P = self.P
        nh, nkv, hd, eps = P["nh"], P["nkv"], P["hd"], P["eps"]
        W, grp = ids.shape[0], nh // nkv
        start = st.shape[0]
        N = ch.shape[0] * CHUNK            # the caller's: the window's end rounded up to CHUNK, at least 2 chunks
        seen = torch.where(pos >= 0, pos, 0)                                 # a padded row: position 0
        f = seen[:, None].float() * P["inv"][None, :]
        ang = torch.cat((f, f), -1)
        cos, sin = ang.cos() * P["rscale"], ang.sin() * P["rscale"]

        def rope(t):
            h2 = hd // 2
            return t * cos[:, None] + torch.cat((-t[..., h2:], t[..., :h2]), -1) * sin[:, None]
        mask = torch.arange(N)[None, :] > seen[:, None]                       # [W, N]
        x = P["emb"][ids]
        for L, kc, vc in zip(P["layers"], ks, vs, strict=True):
            h = F.rms_norm(x, (x.shape[-1],), L["ln1"], eps)
            q, kk, v = (h @ L["wqkv"]).split((nh * hd, nkv * hd, nkv * hd), -1)
            q = rope(F.rms_norm(q.view(W, nh, hd), (hd,), L["qn"], eps))
            kt = rope(F.rms_norm(kk.view(W, nkv, hd), (hd,), L["kn"], eps)).transpose(0, 1)
            kc[:, start:start + W].copy_(kt)
            vc[:, start:start + W].copy_(v.view(W, nkv, hd).transpose(0, 1))
            qg = q.view(W, nkv, grp, hd).permute(1, 0, 2, 3).reshape(nkv, W * grp, hd) * hd ** -0.5
            sc = torch.bmm(qg, kc[:, :N].transpose(1, 2)).view(nkv, W, grp, N)
            sc = sc.masked_fill(mask[None, :, None, :], float("-inf")).view(nkv, W * grp, N)
            p = torch.softmax(sc, -1)
            pc = p.view(nkv, W * grp, N // CHUNK, CHUNK).transpose(1, 2)          # [nkv, chunks, R, C]
            vcc = vc[:, :N].reshape(nkv, N // CHUNK, CHUNK, hd)
            o = torch.matmul(pc, vcc).sum(1)                                      # chunk order
            o = o.view(nkv, W, grp, hd).permute(1, 0, 2, 3).reshape(W, nh * hd)
            x = moe_half(P, L, x + o @ L["wo"])
        hid = F.rms_norm(x, (x.shape[-1],), P["norm"], eps)
        return hid @ P["head"]


def build(P: dict[str, Any], width: int, kcs: list, vcs: list, capacity: int, path: Path, chunked: bool = False):
    from torch.export import Dim, export

    S = Dim("start", min=2, max=capacity - 2 * width - 2)
    start = 16
    ids = torch.zeros(width, dtype=torch.long)
    L = len(kcs)
    with torch.no_grad():
        if chunked:
            buf = torch.zeros(capacity)
            C = Dim("chunks", min=2, max=capacity // CHUNK - 1)   # N < capacity: N == S would be specialized
            ep = export(_ChunkedStep(P), (ids, torch.arange(width), buf[:start], buf[:2], kcs, vcs),
                        dynamic_shapes=(None, None, {0: S}, {0: C}, [None] * L, [None] * L))
        else:
            ks = [k[:, :start] for k in kcs]
            vs = [v[:, :start] for v in vcs]
            ep = export(_Step(P), (ids, ks, vs), dynamic_shapes=(None, [{1: S} for _ in ks], [{1: S} for _ in vs]))
        out = torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    loader = torch._C._aoti.AOTIModelPackageLoader(str(out), "model", False, 1, -1)

    def step(win: torch.Tensor, st: int, real: int | None = None) -> torch.Tensor:
        """Logits of the window at start st (its first `real` rows real, the rest padding: chunked only; the plain
        form computes every row alike)."""
        if chunked:
            n = width if real is None else real
            pos = torch.where(torch.arange(width) < n, st + torch.arange(width), -1)
            chunks = max(2, -(-(st + width) // CHUNK))
            return loader.boxed_run([win, pos, buf[:st], buf[:chunks], *kcs, *vcs])[0]
        res = loader.boxed_run([win, *[k[:, :st] for k in kcs], *[v[:, :st] for v in vcs]])
        logits, k_new, v_new = res[0], res[1:1 + L], res[1 + L:1 + 2 * L]
        write(kcs, vcs, k_new, v_new, st)
        return logits
    return step


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--task", default="code")
    ap.add_argument("--attention", choices=("plain", "chunked"), default="chunked",
                    help="plain: the cache part and the window part as two products (bench/cpu_compile.py); chunked: "
                         "the shipped step's structure, the window's K/V written in place first")
    ap.add_argument("--prefix", type=int, default=0,
                    help="the window starts after this many prompt tokens (default: the whole prompt); 508 with "
                         "--task long puts a 4-row window's end on the 512 boundary and its last row alone past it")
    args = ap.parse_args(argv)
    from runtime.engine import Engine
    from runtime.gpu import static_step as ss

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "threads": torch.get_num_threads(), "rows": []}
    if args.attention == "plain" and args.prefix:
        raise SystemExit("--prefix is for --attention chunked.")
    table, promise = [], []
    with torch.no_grad(), tempfile.TemporaryDirectory() as td:
        eng = Engine.build(NANO, "none", device="cpu", context=4096)
        ids = eng.tokenizer.encode(task_prompts()[args.task]).ids
        if args.prefix:
            ids = ids[:args.prefix + max(int(w) for w in args.widths.split(","))]
        eng.generate(ids[:args.prefix] if args.prefix else ids, draft=False, max_new_tokens=1, stop_ids=set(),
                     width=1)                                                            # prefill into eng.kv
        kv, start = eng.kv, eng.kv.length
        P = weights(eng.model)
        kcs, vcs = float_caches(kv, len(P["layers"]))
        k0, v0 = [k.clone() for k in kcs], [v.clone() for v in vcs]

        def restore() -> None:
            for a, b in zip(kcs + vcs, k0 + v0, strict=True):
                a.copy_(b)
        for width in [int(w) for w in args.widths.split(",") if w]:
            t0 = time.time()
            chunked = args.attention == "chunked"
            comp = build(P, width, kcs, vcs, kv.capacity, Path(td) / f"w{width}.pt2", chunked=chunked)
            build_s = time.time() - t0
            shipped = ss.StaticStep(eng.model, kv, width, graph=False)
            win = torch.tensor(ids[start:start + width]) if args.prefix else torch.tensor(ids[-width:])

            def run_shipped(shipped=shipped, win=win):
                kv.length = start
                return shipped(win[None], kv).logits[0]

            def run_comp(comp=comp, win=win):
                return comp(win, start)
            ref = run_shipped().float().clone()
            got = run_comp()
            restore()
            ts: dict[str, list[float]] = {"shipped": [], "compiled": []}
            for _ in range(args.rounds):
                for name, fn in (("shipped", run_shipped), ("compiled", run_comp)):
                    c0 = time.process_time()
                    for _ in range(args.steps):
                        fn()
                    ts[name].append((time.process_time() - c0) / args.steps * 1e3)
            restore()
            row = {"width": width, "context": start, "build_s": build_s,
                   **{f"{k}_ms": median(v) for k, v in ts.items()},
                   "max_abs_vs_shipped": float((got - ref).abs().max()),
                   "top1_same": bool((got.argmax(-1) == ref.argmax(-1)).all())}
            # the promise at this width: padding rows, and the window position
            if width > 1:
                pad = win.clone()
                pad[1:] = 0
                a = comp(win, start)[0].clone()
                restore()
                b = comp(pad, start, 1)[0].clone()       # one real row, padding after it
                restore()
                row["pad_bit_equal"] = bool(torch.equal(a, b))
                full = comp(win, start).clone()          # writes rows 0..W-1 at start..
                j = width - 1
                alone = win.clone()
                alone[0], alone[1:] = win[j], 0
                c = comp(alone, start + j, 1)[0].clone()  # row j's token at its position, as row 0, padding after
                restore()
                row["position_bit_equal"] = bool(torch.equal(full[j], c))
                row["position_max_abs"] = float((full[j] - c).abs().max())
                promise.append([width, row["pad_bit_equal"], row["position_bit_equal"],
                                f"{row['position_max_abs']:.1e}"])
            res["rows"].append(row)
            table.append([width, start, f"{row['shipped_ms']:.3f}", f"{row['compiled_ms']:.3f}",
                          f"{row['shipped_ms'] / row['compiled_ms']:.2f}x", f"{build_s:.0f}",
                          f"{row['max_abs_vs_shipped']:.1e}", row["top1_same"]])
            print(f"  W={width}: shipped {row['shipped_ms']:.3f} ms, compiled {row['compiled_ms']:.3f}", flush=True)
    print_table(f"The target step on the bundled pack, {args.task} prompt ({start} tokens), ms per step (process "
                f"time, median of {args.rounds} interleaved rounds, {torch.get_num_threads()} thread(s))",
                ["W", "context", "shipped", "compiled (AOTI)", "shipped / compiled", "build s", "max |dlogit|",
                 "top-1 same"], table)
    if promise:
        print_table("The lossless promise at a fixed width, compiled step (bit-equal logits)",
                    ["W", "padding after a row", "window position", "max |difference|"], promise)
    write_json(f"cpu_aoti_step_{args.attention}.json", res)
    return res


if __name__ == "__main__":
    main()
