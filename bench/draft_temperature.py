"""Sampled speculation with the drafter drawing hotter than the request: what calibration measures, and what the
loop gets.

    python bench/draft_temperature.py [--device cpu] [--block 4] [--seeds 30] [--new-tokens 96]
                                      [--settings 0.7:0.9,1.0:1.0] [--scales 1.0,1.5] [--tasks code,math,prose]

The bundled pack's target and MTP head. First the teacher-forced overlap calibration computes
(calibrate/draft_temperature.py: sum_x min(p, q) of the head's first step against the target, on the calibration
prompts, at each scale and sampling setting); then the real loop (`Engine.generate`, block `--block`, no floor),
sampled with seeds 0..N-1 at each setting and scale: tokens a window (mean over the runs) and decode tok/s (median).
A different scale changes which tokens are drawn, not their distribution, so the runs differ by sampling noise as
well: that is why there are many seeds. On a CPU, run it with OMP_NUM_THREADS=1 for one thread. Writes
draft_temperature.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, machine, print_table, task_prompts, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--settings", default="0.7:0.9,1.0:1.0", help="temperature:top_p pairs")
    ap.add_argument("--scales", default="1.0,1.5")
    ap.add_argument("--tasks", default="code,math,prose")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/draft_temperature.py: no CUDA device; pass --device cpu.")
        return 2
    from calibrate import draft_temperature as D
    from calibrate.fixtures import load_prompts
    from runtime.engine import Engine, SamplingParams

    eng = Engine.build(NANO, "mtp", device=args.device, block=args.block, spec_min_p=0.0)
    t0 = time.perf_counter()
    tf = D.measure(eng, [eng.encode(t) for t in load_prompts().values()])
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "teacher_forced": tf,
                           "measure_s": round(time.perf_counter() - t0, 3), "loop": []}
    print_table("teacher-forced first-proposal acceptance, sum_x min(p, q) (calibration prompts)",
                ["scale", *tf["by_setting"], "mean"],
                [[s, *[v[s] for v in tf["by_setting"].values()], tf["overlap"][s]] for s in tf["overlap"]])
    print(f"calibration would choose {tf['scale']:g} ({res['measure_s']:.1f} s)")
    prompts = task_prompts()
    settings = [tuple(float(x) for x in pair.split(":")) for pair in args.settings.split(",")]
    scales = [float(s) for s in args.scales.split(",")]
    eng.generate(prompts["code"], 16, sampling=SamplingParams(temperature=1.0, seed=0))       # warm-up
    rows = []
    for temp, top_p in settings:
        for task in args.tasks.split(","):
            base = None
            for scale in scales:
                tpw, tps = [], []
                for seed in range(args.seeds):
                    sp = SamplingParams(temperature=temp, top_p=top_p, seed=seed)
                    st = eng.generate(prompts[task], args.new_tokens, sampling=sp, draft_temp_scale=scale).stats
                    tpw.append(st["generated_tokens"] / max(1, st["windows"]))
                    tps.append(st["decode_tok_s"])
                r = {"temperature": temp, "top_p": top_p, "task": task, "scale": scale,
                     "tokens_per_window": statistics.mean(tpw), "tok_s": statistics.median(tps)}
                base = base or r
                r["tok_s_vs_scale_1"] = r["tok_s"] / base["tok_s"]
                res["loop"].append(r)
                rows.append([f"T {temp:g} / top-p {top_p:g}", task, scale, r["tokens_per_window"], r["tok_s"],
                             r["tok_s_vs_scale_1"]])
    print_table(f"sampled MTP block {args.block}, {args.seeds} seeds x {args.new_tokens} tokens "
                f"({res['machine'].get('gpu') or res['machine']['cpu']}, {torch.get_num_threads()} threads)",
                ["setting", "task", "scale", "tokens / window", "tok/s (median)", "x scale 1"], rows)
    write_json("draft_temperature.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
