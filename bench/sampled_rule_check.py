"""The sampled acceptance rule from CUDA graphs against the same rule as eager ops (runtime/speculative.py
`SAMPLED_GRAPHS`), on the real device path: the bundled pack's engine, target alone, MTP and DFlash2.

    python bench/sampled_rule_check.py [--device cuda] [--new-tokens 96] [--repeats 3]

For each drafter and several sampling settings (temperature, top-k, top-p) on the code and prose prompts, a
generation with a fixed seed runs both ways; the tokens must be equal (the uniforms are the same draws either way,
so the graphs must reproduce the eager ops exactly). Next to it, decode tok/s both ways (median of `repeats` runs,
alternating): the pack's target step is about 0.3 ms on an H200, so the rule's launches show. Exit 1 on any
difference. Writes sampled_rule_check.json ($OUT on the device).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, NANO_DFLASH2, machine, median, print_table, task_prompts, write_json  # noqa: E402
from runtime import speculative  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

SETTINGS = {"t0.8 top-p 0.95": dict(temperature=0.8, top_p=0.95), "t1.0 top-k 20": dict(temperature=1.0, top_k=20),
            "t0.7": dict(temperature=0.7)}


def run(eng: Engine, prompt: str, graphs: bool, n: int, sp: SamplingParams):
    speculative.SAMPLED_GRAPHS = graphs
    try:
        return eng.generate(prompt, max_new_tokens=n, sampling=sp, stop_ids=set())
    finally:
        speculative.SAMPLED_GRAPHS = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    prompts = {k: v for k, v in task_prompts().items() if k in ("code", "prose")}
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for kind, path, block in (("none", None, None), ("mtp", None, 4), ("dflash2", NANO_DFLASH2, 8)):
            eng = Engine.build(NANO, kind, drafter_path=path, device=args.device, context=4096, block=block)
            for label, kw in SETTINGS.items():
                for task, prompt in prompts.items():
                    sp = SamplingParams(seed=11, **kw)
                    # captures, untimed: a full generation, so every window shape the timed runs meet is made
                    # (a short one would leave the full block's graph to the first timed run)
                    run(eng, prompt, True, args.new_tokens, sp)
                    tok_s: dict[bool, list[float]] = {True: [], False: []}
                    toks: dict[bool, list[int]] = {}
                    for _ in range(args.repeats):
                        for graphs in (True, False):
                            r = run(eng, prompt, graphs, args.new_tokens, sp)
                            tok_s[graphs].append(r.stats["decode_tok_s"])
                            if graphs in toks and toks[graphs] != r.token_ids:
                                toks[graphs] = []                # a run that does not repeat itself
                            toks.setdefault(graphs, r.token_ids)
                    rows.append({"drafter": kind, "sampling": label, "task": task, "tokens": len(toks[True]),
                                 "equal": bool(toks[True]) and toks[True] == toks[False],
                                 "tok_s_graphs": median(tok_s[True]), "tok_s_eager": median(tok_s[False])})
            del eng
    print_table(f"sampled acceptance from graphs vs eager ops, bundled pack ({args.device})",
                ["drafter", "sampling", "task", "tokens", "equal", "tok/s graphs", "tok/s eager", "x"],
                [[r["drafter"], r["sampling"], r["task"], r["tokens"], r["equal"], f"{r['tok_s_graphs']:.0f}",
                  f"{r['tok_s_eager']:.0f}", f"{r['tok_s_graphs'] / max(r['tok_s_eager'], 1e-9):.2f}"]
                 for r in rows])
    ok = all(r["equal"] for r in rows)
    errors = speculative.sampled_rule(torch.device(args.device)).errors
    write_json("sampled_rule_check.json", {"machine": machine(), "rows": rows, "ok": ok, "errors": errors})
    print("ok" if ok else "MISMATCH", errors)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
