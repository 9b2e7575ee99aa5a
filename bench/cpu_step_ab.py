"""The CPU step's switches, each off against on, interleaved in one process, on the bundled pack.

    OMP_NUM_THREADS=1 python bench/cpu_step_ab.py [--tasks code,long] [--widths 1,4] [--rounds 12] [--steps 40]
        [--switches fewer_ops,row_bmm,shared_keys,window] [--prefix N]

For each task prompt (prefilled once), width and switch: the engine's fixed-width step (runtime/gpu/static_step.py)
on a window of `width` real rows at the prompt's end, timed `steps` times in a row, alternating off and on for
`rounds` rounds; median ms of process time per step (a shared VM's other tenants do not count). Also whether the
two settings give the same logits. Switches (module flags of runtime/gpu/static_step.py, docs/models.md "Numerics"):

- plan: `CPU_PLAN` (runtime/models/cpu_plan.py: each layer's weights gathered once, the same ops) against
  cpu_rows.py's lookups per op;
- fewer_ops: `CPU_FEWER_OPS` (runtime/models/cpu_rows.py) against the module path's ops;
- row_bmm: `CPU_ROW_BMM` (a row's attention by batched products) against SDPA per row;
- shared_keys: `CPU_SHARED_FROM` as set (a window's rows read the keys before their chunk once) against never
  (only where a window's rows attend alone: `CPU_WINDOW_CHUNK` = 0);
- window: `CPU_WINDOW_CHUNK` as set (a window's rows attend together: one scores product, the values in fixed
  chunks) against each row alone (0).

Writes `cpu_step_ab.json`. Why a separate script: on a 2-core VM whose speed drifts by 10-15% within minutes,
only an interleaved A/B in one process shows a change of a few percent.
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

SWITCHES = {          # name -> (flag, value off, value on)
    "plan": ("CPU_PLAN", False, True),
    "fewer_ops": ("CPU_FEWER_OPS", False, True),
    "row_bmm": ("CPU_ROW_BMM", False, True),
    "shared_keys": ("CPU_SHARED_FROM", 1 << 30, None),      # None: the module's own value
    "window": ("CPU_WINDOW_CHUNK", 0, None),
}


def time_steps(step, kv, window: torch.Tensor, start: int, steps: int) -> float:
    """ms of process time per step, the window appended at `start` each time."""
    c0 = time.process_time()
    for _ in range(steps):
        kv.length = start
        step(window, kv)
    return (time.process_time() - c0) / steps * 1e3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="code,long")
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--switches", default=",".join(SWITCHES))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prefix", type=int, default=0, help="cut each prompt to its first N tokens (0: whole)")
    args = ap.parse_args(argv)
    from runtime.engine import Engine
    from runtime.gpu import static_step as ss

    with torch.no_grad():
        return _run(args, Engine.build(NANO, "none", device="cpu", context=4096), ss)


def _run(args: argparse.Namespace, eng, ss) -> dict[str, Any]:
    prompts = task_prompts()
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "threads": torch.get_num_threads(), "rows": []}
    rows = []
    for task in [t for t in args.tasks.split(",") if t]:
        ids = eng.tokenizer.encode(prompts[task]).ids
        if args.prefix:
            ids = ids[:args.prefix]
        eng.generate(ids, draft=False, max_new_tokens=1, stop_ids=set(), width=1)    # prefill into eng.kv
        kv, start = eng.kv, eng.kv.length
        for width in [int(w) for w in args.widths.split(",") if w]:
            step = ss.StaticStep(eng.model, kv, width, graph=False)
            window = torch.tensor([ids[-width:]])
            for name in [s for s in args.switches.split(",") if s]:
                if name == "shared_keys" and (width == 1 or start + width <= ss.CPU_SHARED_FROM
                                              or ss.CPU_WINDOW_CHUNK):
                    continue          # nothing to share: one row, a context below the threshold, rows together
                if name == "window" and width == 1:
                    continue          # one row attends alone either way
                flag, off, on = SWITCHES[name]
                on = getattr(ss, flag) if on is None else on
                keep = getattr(ss, flag)
                times: dict[str, list[float]] = {"off": [], "on": []}
                logits = {}
                try:
                    for side, val in (("off", off), ("on", on)):       # warm-up, and each side's logits
                        setattr(ss, flag, val)
                        kv.length = start
                        logits[side] = step(window, kv).logits.clone()
                        time_steps(step, kv, window, start, 3)
                    for _ in range(args.rounds):
                        for side, val in (("off", off), ("on", on)):
                            setattr(ss, flag, val)
                            times[side].append(time_steps(step, kv, window, start, args.steps))
                finally:
                    setattr(ss, flag, keep)
                a, b = median(times["off"]), median(times["on"])
                rec = {"task": task, "context": start, "width": width, "switch": name, "off_ms": a, "on_ms": b,
                       "change": b / a - 1.0, "same_logits": bool(torch.equal(logits["off"], logits["on"]))}
                res["rows"].append(rec)
                rows.append([task, start, width, name, a, b, f"{b / a - 1.0:+.1%}", rec["same_logits"]])
                print(f"  {task} {start} W={width} {name}: {a:.3f} -> {b:.3f} ms", flush=True)
    print_table(f"CPU step switches, off vs on (medians of {args.rounds} interleaved rounds of {args.steps} steps, "
                f"{torch.get_num_threads()} thread(s))",
                ["task", "context", "width", "switch", "off ms", "on ms", "change", "same logits"], rows)
    write_json("cpu_step_ab.json", res)
    return res


if __name__ == "__main__":
    main()
