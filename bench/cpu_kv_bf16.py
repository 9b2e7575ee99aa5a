"""The compiled CPU target step with its KV cache in bf16 (`[memory] kv_dtype = "bf16"`) against the default fp32
cache, side by side in one process on the bundled pack: decode speed and how long greedy output stays the same.

    OMP_NUM_THREADS=1 python bench/cpu_kv_bf16.py [--tasks code,math,prose,long] [--new-tokens 128] [--repeats 5]

Two target-alone engines (no drafter, one-row compiled step), one per cache dtype, run each task's prompt in turn
`repeats` times; per task: median decode tok/s of each, the greedy tokens both produce until the first that
differs, and the K/V bytes a token reads at the prompt's end. Writes `cpu_kv_bf16.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, machine, median, print_table, task_prompts, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="code,math,prose,long")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from runtime.engine import Engine

    engines = {}
    for kvd in ("float32", "bf16"):
        eng = Engine.build(NANO, "none", device="cpu", context=4096, kv_dtype=kvd)
        why = eng.compile_target(build=True)
        if why:
            raise SystemExit(f"the compiled step is not available here ({kvd} cache): {why}.")
        engines[kvd] = eng
    cfg = engines["float32"].model.cfg
    prompts = task_prompts()
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "threads": torch.get_num_threads(), "rows": []}
    table = []
    for task in args.tasks.split(","):
        ids = engines["float32"].tokenizer.encode(prompts[task]).ids
        speeds: dict[str, list[float]] = {k: [] for k in engines}
        outs: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for kvd, eng in engines.items():
                r = eng.generate(ids, max_new_tokens=args.new_tokens, stop_ids=set())
                speeds[kvd].append(r.stats["decode_tok_s"])
                outs[kvd] = r.token_ids
        a, b = outs["float32"], outs["bf16"]
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * len(ids)
        row = {"task": task, "prompt_tokens": len(ids), "fp32_tok_s": median(speeds["float32"]),
               "bf16_tok_s": median(speeds["bf16"]), "same_tokens": same, "new_tokens": len(a),
               "kv_mb_fp32": kv_bytes * 4 / 1e6, "kv_mb_bf16": kv_bytes * 2 / 1e6}
        res["rows"].append(row)
        table.append([task, len(ids), f"{row['kv_mb_fp32']:.1f} / {row['kv_mb_bf16']:.1f}", f"{row['fp32_tok_s']:,.0f}",
                      f"{row['bf16_tok_s']:,.0f}", f"{row['bf16_tok_s'] / row['fp32_tok_s']:.2f}x", f"{same} / {len(a)}"])
    print_table(f"compiled CPU target alone, fp32 vs bf16 KV cache (bundled pack, {torch.get_num_threads()} thread(s), "
                f"medians of {args.repeats})",
                ["task", "prompt", "K/V MB a token (fp32 / bf16)", "fp32 tok/s", "bf16 tok/s", "bf16 / fp32",
                 "same greedy tokens"], table)
    write_json("cpu_kv_bf16.json", res)
    return res


if __name__ == "__main__":
    main()
