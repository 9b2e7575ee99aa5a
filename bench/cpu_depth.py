"""Would a deeper bundled target make MTP drafting pay on a 1-thread CPU? The target's step at depths 6, 12 and 24
layers against the same drafter, before anyone spends GPU time re-training a deeper pack.

    OMP_NUM_THREADS=1 python bench/cpu_depth.py [--block 5] [--depths 6,12,24] [--rounds 8] [--steps 30]

1. The bundled pack with its MTP head at `--block` decodes the code prompt (96 tokens, floor `--min-p`): tokens per
   window (tau) and the draft time per window (D, the loop's `draft_window_s` / windows) as that run measured them.
2. The target's fixed-width step (runtime/gpu/static_step.py, the CPU path) at one row (T) and at `--block` rows
   (V, a verify window) for a target of each depth: the pack's 6 layers followed by deep copies of them in turn
   (the copies' outputs mean nothing; a step costs what a target of that depth costs: the same ops on the same
   shapes, each layer's own weights), the KV cache filled with random values up to the prompt's length. Steps of
   every depth and width interleave, `--rounds` rounds of `--steps` steps; medians of process time.
3. The speed-up a window would give at that depth: tau * T / (D + V), and its ceiling with a free drafter,
   tau * T / V. The drafter (one MTP layer) does not grow with the target.

Writes `cpu_depth.json`. What it assumes: a re-trained deeper target and its MTP head accept as often as the pack's
(tau unchanged).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, machine, median, print_table, task_prompts, write_json  # noqa: E402


def deeper(layers: list, depth: int) -> torch.nn.ModuleList:
    """The pack's layers, then deep copies of them in turn, `depth` in all (each MoE layer numbered by place)."""
    out = [layers[i % len(layers)] if i < len(layers) else copy.deepcopy(layers[i % len(layers)]) for i in range(depth)]
    for i, layer in enumerate(out):
        layer.mlp.layer_idx = i
    return torch.nn.ModuleList(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--min-p", type=float, default=0.3)
    ap.add_argument("--depths", default="6,12,24")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    from runtime.engine import Engine
    from runtime.gpu.static_step import StaticStep
    from runtime.kv import KVCache

    torch.manual_seed(0)
    with torch.no_grad():
        eng = Engine.build(NANO, "mtp", device="cpu", context=4096, block=args.block)
        ids = eng.tokenizer.encode(task_prompts()["code"]).ids
        eng.generate(ids, max_new_tokens=96, stop_ids=set(), spec_min_p=args.min_p)          # warm-up
        st = eng.generate(ids, max_new_tokens=96, stop_ids=set(), spec_min_p=args.min_p).stats
        tau = (st["accepted"] + st["windows"]) / st["windows"]
        draft_ms = st["draft_window_s"] / st["windows"] * 1e3
        model, cfg = eng.model, eng.model.cfg
        base = list(model.model.layers)
        n0 = cfg.num_hidden_layers
        depths = [int(d) for d in args.depths.split(",") if d]
        setups = {}
        for d in depths:
            kv = KVCache(d, cfg.num_key_value_heads, cfg.head_dim, len(ids) + 64)
            kv.k.normal_()
            kv.v.normal_()
            setups[d] = (deeper(base, d), kv)

        def use(d: int) -> None:
            model.model.layers = setups[d][0]
            cfg.num_hidden_layers = d

        steps: dict[tuple[int, int], Any] = {}
        for d in depths:
            use(d)
            for w in (1, args.block):
                steps[(d, w)] = StaticStep(model, setups[d][1], w, graph=False)
        times: dict[tuple[int, int], list[float]] = {k: [] for k in steps}

        def run(k: tuple[int, int], n: int) -> float:
            d, w = k
            use(d)
            kv, win = setups[d][1], torch.tensor([ids[-w:]])
            t = time.process_time()
            for _ in range(n):
                kv.length = len(ids) - w
                steps[k](win, kv)
            return (time.process_time() - t) / n * 1e3

        for k in steps:
            run(k, 3)
        for _ in range(args.rounds):
            for k in steps:
                times[k].append(run(k, args.steps))
        use(n0)
        model.model.layers = torch.nn.ModuleList(base)
    rows = []
    for d in depths:
        t1, vb = median(times[(d, 1)]), median(times[(d, args.block)])
        rows.append({"depth": d, "step_ms": t1, "verify_ms": vb, "verify_over_step": vb / t1,
                     "speedup": tau * t1 / (draft_ms + vb), "speedup_free_drafter": tau * t1 / vb})
    res = {"machine": machine(), "threads": torch.get_num_threads(), "args": vars(args), "tokens_per_window": tau,
           "draft_ms_per_window": draft_ms, "rows": rows}
    print_table(f"MTP block {args.block} on the code prompt: {tau:.2f} tokens a window, draft {draft_ms:.2f} ms a "
                f"window; the target's step by depth ({torch.get_num_threads()} thread(s), medians of {args.rounds} "
                f"rounds)", ["layers", "step ms", f"verify ({args.block} rows) ms", "verify / step",
                             "speed-up", "speed-up, free drafter"],
                [[r["depth"], r["step_ms"], r["verify_ms"], r["verify_over_step"], r["speedup"],
                  r["speedup_free_drafter"]] for r in rows])
    write_json("cpu_depth.json", res)
    return res


if __name__ == "__main__":
    main()
