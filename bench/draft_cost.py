"""Where a drafter's time per window goes on a GPU: its CUDA graphs alone against what the speculative loop pays.

    python bench/draft_cost.py [--new-tokens 96] [--replays 50] [--tasks code,long]

For the bundled pack's MTP head (its layer through the fused decode kernels, and through its modules as before:
runtime/drafters/mtp.py `FUSED`) and its DFlash2 head (blocks 4 and 8): one greedy run on the code prompt with the
engine's fixed-width step (each of `--tasks`' prompts: code, and long, a 3k-token prompt), then
- loop: draft ms per window as the loop measures it (CUDA events around `propose` and `observe` inside the windows,
  the loop's `draft_window_s`: GPU time, plus any time the GPU sat idle waiting for the host to queue the next
  launch), and a window's wall time less its verify span (what the window spends outside the target's step), with
  the next window drafted ahead of each read (the loop's default, docs/models.md "Drafting ahead") and after it
  (`speculative.DRAFT_AHEAD = False`, as before); the drafter's share of the prompt (`observe_prompt_s`, once a
  prompt) is its own row, not spread over the windows;
- graphs: the GPU time of each of the drafter's graphs the run captured, replayed back to back (`replays` times
  between two events): what drafting costs when the host keeps ahead. The chain of n steps and the observe graph
  together are what one window needs;
- launches: kernels a graph holds (torch.profiler, one replay), so a reader sees whether a graph is launch-bound.
The difference between loop and graphs is host work the GPU waits for. Writes draft_cost.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, NANO_DFLASH2, machine, median, print_table, task_prompts, write_json  # noqa: E402


def graph_ms(g: torch.cuda.CUDAGraph, n: int) -> float:
    """GPU milliseconds per replay of g, n replays back to back (median of 3 such runs)."""
    out = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / n)
    return median(out)


def kernels_in(g: torch.cuda.CUDAGraph) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(eng, label: str, block: int, ids: list[int], new_tokens: int, replays: int, task: str = "code"
            ) -> list[dict[str, Any]]:
    from runtime import speculative

    d = eng.drafter
    eng.generate(ids, max_new_tokens=8, block=block, spec_min_p=0.0, stop_ids=set())   # attaches the graphs
    d.graphs.graphs.clear()                      # then only this block's graphs: captured by the first full run
    rows = []
    for ahead in (True, False):
        speculative.DRAFT_AHEAD = ahead
        eng.generate(ids, max_new_tokens=new_tokens, block=block, spec_min_p=0.0, stop_ids=set())
        r = eng.generate(ids, max_new_tokens=new_tokens, block=block, spec_min_p=0.0, stop_ids=set())
        st = r.stats
        win = max(1, st["windows"])
        how = "drafted ahead" if ahead else "after the read"
        rows += [{"drafter": label, "block": block, "task": task, "what": f"loop ({how}): draft ms per window",
                  "ms": 1e3 * st["draft_window_s"] / win, "drafted_ahead": st["drafted_ahead"] / win,
                  "tokens_per_window": (st["accepted"] + win) / win, "decode_tok_s": st["decode_tok_s"]},
                 {"drafter": label, "block": block, "task": task,
                  "what": f"loop ({how}): window ms - verify ms",
                  "ms": 1e3 * (st["decode_s"] - st["verify_s"]) / win,
                  "tokens_per_window": (st["accepted"] + win) / win, "decode_tok_s": st["decode_tok_s"]}]
    speculative.DRAFT_AHEAD = True
    rows.append({"drafter": label, "block": block, "task": task, "what": "loop: the prompt's observation, once",
                 "ms": 1e3 * st["observe_prompt_s"], "prompt_tokens": st["prompt_tokens"]})
    for key, (g, _) in d.graphs.graphs.items():
        rows.append({"drafter": label, "block": block, "task": task, "what": f"graph {key}", "ms": graph_ms(g, replays),
                     "launches": kernels_in(g)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--tasks", default="code", help="prompts (bench/common.py task_prompts): code, long, math, prose")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/draft_cost.py needs a CUDA GPU (it times CUDA graphs).", file=sys.stderr)
        return 2
    from runtime.drafters import mtp
    from runtime.engine import Engine

    rows: list[dict[str, Any]] = []
    tasks = [t for t in args.tasks.split(",") if t]
    prompts: dict[str, list[int]] = {}
    for fused in (True, False):
        mtp.FUSED = fused
        eng = Engine.build(NANO, "mtp", device="cuda", context=4096, block=4)
        prompts = prompts or {t: eng.tokenizer.encode(task_prompts()[t]).ids for t in tasks}
        for task, ids in prompts.items():
            for block in (4, 5):
                rows += measure(eng, f"MTP ({'fused layer' if fused else 'modules'})", block, ids, args.new_tokens,
                                args.replays, task)
        del eng
    mtp.FUSED = True
    eng = Engine.build(NANO, "dflash2", drafter_path=NANO_DFLASH2, device="cuda", context=4096, block=8)
    for task, ids in prompts.items():
        for block in (4, 8):
            rows += measure(eng, "DFlash2 bf16", block, ids, args.new_tokens, args.replays, task)
    write_json("draft_cost.json", {"machine": machine(), "args": vars(args), "rows": rows})
    print_table(f"Drafter cost per window, bundled pack ({machine().get('gpu')})",
                ["drafter", "block", "task", "what", "ms", "launches", "tok/window", "tok/s"],
                [[r["drafter"], r["block"], r["task"], r["what"], r["ms"], r.get("launches"), r.get("tokens_per_window"),
                  r.get("decode_tok_s")] for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
