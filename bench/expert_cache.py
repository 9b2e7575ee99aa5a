"""What the expert cache does when only part of the experts fit: tok/s and hit rate for all / half / a quarter of
the routed experts resident on the device (the rest computed on the CPU from host memory), target-only and MTP.

    python bench/expert_cache.py [--device cuda] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import NANO, PROMPTS, machine, print_table, write_json  # noqa: E402
from runtime.engine import Engine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    prompt = (PROMPTS / "code.txt").read_text()
    rows, out = [], []
    for kind in ("none", "mtp"):
        probe = Engine.build(NANO, drafter_kind="none", device="cpu")
        total = probe.experts.total
        del probe
        ref = None
        for slots in (total, total // 2, total // 4):
            eng = Engine.build(NANO, drafter_kind=kind, device=a.device, expert_slots=slots, context=2048)
            eng.generate(prompt, max_new_tokens=16, stop_ids=set())           # warm-up (graphs, kernels)
            speeds = []
            for _ in range(a.repeats):
                h0, m0 = eng.experts.hits, eng.experts.misses
                t0 = time.perf_counter()
                res = eng.generate(prompt, max_new_tokens=a.new_tokens, stop_ids=set())
                wall = time.perf_counter() - t0
                speeds.append(res.stats["decode_tok_s"])
                hits, misses = eng.experts.hits - h0, eng.experts.misses - m0
            ref = res.token_ids if ref is None else ref
            same = res.token_ids == ref
            hit_rate = hits / max(1, hits + misses)
            rec = {"drafter": kind, "slots": slots, "total": total, "decode_tok_s": statistics.median(speeds),
                   "hit_rate": hit_rate, "hits": hits, "misses": misses, "wall_s": wall,
                   "same_tokens_as_all_resident": same, "memory": eng.memory_report()}
            out.append(rec)
            rows.append([kind, f"{slots}/{total}", f"{rec['decode_tok_s']:.1f}", f"{hit_rate:.2f}", str(same)])
            del eng
    print_table("expert cache: resident slots vs speed (code prompt, greedy)",
                ["drafter", "resident", "decode tok/s", "hit rate", "same ids"], rows)
    write_json("expert_cache.json", {"machine": machine(), "rows": out, "new_tokens": a.new_tokens})


if __name__ == "__main__":
    main()
