"""Decoding ahead on the real device path: the bundled pack's engine, target alone, with the next step queued before
each token's read (runtime/speculative.py `DECODE_AHEAD`) and after it, for every way a generation ends.

    python bench/decode_ahead_check.py [--device cuda] [--new-tokens 48]

For greedy and sampled decoding, on the code and prose prompts, each generation runs both ways: ended by length, by
a stop token first produced mid-generation, and by a cancel after a few windows. Both ways must give the same
tokens, the same stop reason, the same committed cache length and the same committed K/V bits (the step queued
ahead of a stop or a cancel is discarded). Exit 1 when any differs. On a CPU the check runs the same code with
`DECODE_AHEAD_CPU` (there the step runs as it is called). Writes decode_ahead_check.json ($OUT on the device).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, machine, print_table, task_prompts, write_json  # noqa: E402
from runtime import speculative  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402


def run(eng: Engine, prompt: str, ahead: bool, n: int, sampling, stop_ids: set[int], cancel_after: int | None):
    """(result, committed length, committed K, committed V) of one generation."""
    speculative.DECODE_AHEAD = ahead
    asked = [0]

    def cancel() -> bool:
        asked[0] += 1
        return cancel_after is not None and asked[0] > cancel_after

    try:
        r = eng.generate(prompt, max_new_tokens=n, sampling=sampling, stop_ids=stop_ids, cancel=cancel)
    finally:
        speculative.DECODE_AHEAD = True
    k, v = eng.kv.committed()
    return r, eng.kv.length, k.clone(), v.clone()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    speculative.DECODE_AHEAD_CPU = True
    eng = Engine.build(NANO, "none", device=args.device, context=4096)
    prompts = {k: v for k, v in task_prompts().items() if k in ("code", "prose")}
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for mode, sp in (("greedy", None), ("sampled", SamplingParams(temperature=0.8, top_p=0.95, seed=7))):
            for task, prompt in prompts.items():
                base = run(eng, prompt, False, args.new_tokens, sp, set(), None)[0].token_ids
                first = [t for i, t in enumerate(base) if i >= 4 and t not in base[:i]]
                ends = {"length": (set(), None), "cancel": (set(), 6)}
                if first:
                    ends["stop"] = ({first[0]}, None)
                for end, (stops, cancel_after) in ends.items():
                    on = run(eng, prompt, True, args.new_tokens, sp, stops, cancel_after)
                    off = run(eng, prompt, False, args.new_tokens, sp, stops, cancel_after)
                    ok = (on[0].token_ids == off[0].token_ids and on[0].stats["stop_reason"] ==
                          off[0].stats["stop_reason"] and on[1] == off[1] and torch.equal(on[2], off[2])
                          and torch.equal(on[3], off[3]))
                    rows.append({"mode": mode, "task": task, "end": end, "tokens": len(on[0].token_ids),
                                 "stop_reason": on[0].stats["stop_reason"], "kv_length": on[1],
                                 "decoded_ahead": on[0].stats["decoded_ahead"],
                                 "decoded_ahead_off": off[0].stats["decoded_ahead"], "equal": ok})
    print_table(f"decoding ahead vs after the read, bundled pack, target alone ({args.device})",
                ["mode", "task", "end", "tokens", "stop reason", "kv length", "queued ahead", "equal"],
                [[r["mode"], r["task"], r["end"], r["tokens"], r["stop_reason"], r["kv_length"], r["decoded_ahead"],
                  r["equal"]] for r in rows])
    ok = all(r["equal"] and r["decoded_ahead"] > 0 and r["decoded_ahead_off"] == 0 for r in rows)
    write_json("decode_ahead_check.json", {"machine": machine(), "rows": rows, "ok": ok})
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
