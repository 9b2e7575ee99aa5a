"""What each C++ op of the compiled CPU target step costs by window width (runtime/cpu_ops.py), on the bundled pack
with a real prompt in the cache: where a W-row verify step's time goes against a one-row step's.

    OMP_NUM_THREADS=1 python bench/cpu_ops_widths.py [--task code] [--widths 1,3,4,5,6,8] [--rounds 7]

Per width: microseconds a call (process time, median of `rounds` rounds) of one layer's q/k/v product and o_proj
(`rows16` over the bf16 copies), its routed experts (`moe_rows`, random distinct experts a row), its attention
(`window_attention` over the prompt's cache, each row at its own position) and the vocabulary head (`rows16`), and
the six layers plus head together. Writes `cpu_ops_widths.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, machine, median, print_table, task_prompts, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="code")
    ap.add_argument("--widths", default="1,3,4,5,6,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    from runtime import target_compiled as tc
    from runtime.engine import Engine

    eng = Engine.build(NANO, "none", device="cpu", context=4096)
    why = eng.compile_target(build=True)
    copies = tc._copies(eng.model)
    if why or copies is None:
        raise SystemExit(f"the compiled step's ops are not available here: {why or 'no bf16 copies'}.")
    ids = eng.tokenizer.encode(task_prompts()[args.task]).ids
    eng.generate(ids, max_new_tokens=2)
    n_ctx = len(ids)
    kv, ops = eng.kv, torch.ops.strata
    la = eng.model.model.layers[0]
    nkv, grp, hd = la.self_attn.nkv, la.self_attn.nh // la.self_attn.nkv, la.self_attn.hd
    H, E, k, inter = eng.model.cfg.hidden_size, la.mlp.n_exp, la.mlp.top_k, la.mlp.inter
    n_layers = len(eng.model.model.layers)
    wq, wo, gu, dn = copies["layers"][0]
    gen = torch.Generator().manual_seed(0)

    def timed(fn, *a) -> float:
        out = []
        for _ in range(args.rounds):
            c0 = time.process_time()
            for _ in range(args.calls):
                fn(*a)
            out.append((time.process_time() - c0) / args.calls * 1e6)
        return median(out)

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "threads": torch.get_num_threads(),
                           "context": n_ctx, "rows": []}
    table = []
    for W in [int(w) for w in args.widths.split(",") if w]:
        x = torch.randn(W, H, generator=gen)
        xo = torch.randn(W, la.self_attn.nh * hd, generator=gen)
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(W)])
        wt = torch.softmax(torch.randn(W, k, generator=gen), -1)
        q = torch.randn(nkv, W * grp, hd, generator=gen)
        seen = torch.arange(n_ctx - W, n_ctx)
        row = {"width": W,
               "qkv_us": timed(ops.rows16, x, wq),
               "o_proj_us": timed(ops.rows16, xo, wo),
               "experts_us": timed(ops.moe_rows, x, gu, dn, idx, wt, inter),
               "attention_us": timed(ops.window_attention, q, kv.k[0, 0], kv.v[0, 0], seen, grp),
               "head_us": timed(ops.rows16, x, copies["head"])}
        row["step_ops_us"] = n_layers * (row["qkv_us"] + row["o_proj_us"] + row["experts_us"]
                                         + row["attention_us"]) + row["head_us"]
        res["rows"].append(row)
        table.append([W] + [f"{row[c]:.1f}" for c in ("qkv_us", "o_proj_us", "experts_us", "attention_us", "head_us",
                                                      "step_ops_us")])
    one = res["rows"][0]["step_ops_us"]
    for r, t in zip(res["rows"], table, strict=True):
        t.append(f"{r['step_ops_us'] / one:.2f}")
    print_table(f"compiled CPU step's ops by width, bundled pack, {args.task} prompt ({n_ctx} tokens of cache), us a call "
                f"(process time, median of {args.rounds}, {torch.get_num_threads()} thread(s))",
                ["width", "q/k/v", "o_proj", "experts", "attention", "head", f"{n_layers} layers + head",
                 "x first width"], table)
    write_json("cpu_ops_widths.json", res)
    return res


if __name__ == "__main__":
    main()
