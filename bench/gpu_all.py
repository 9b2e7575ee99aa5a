"""Everything for one device call, in one process (imports once): kernel checks, decode, drafters, budget.

    OUT=/some/dir python bench/gpu_all.py [--total-seconds 270]

Each part gets a share of the time budget and runs even if an earlier part failed; a short summary comes last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import out_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-seconds", type=float, default=270)
    ap.add_argument("--parts", default="checks,decode,drafters,budget")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer tokens, repeats and contexts")
    a = ap.parse_args()
    t0 = time.monotonic()
    share = {"checks": 0.10, "decode": 0.30, "drafters": 0.33, "budget": 0.27}
    if a.quick:
        share = {"checks": 0.12, "decode": 0.50, "drafters": 0.23, "budget": 0.15}
    status = {}
    parts = a.parts.split(",")
    for part in parts:
        left = a.total_seconds - (time.monotonic() - t0)
        budget = max(10.0, min(left, share[part] * a.total_seconds))
        print(f"\n=== {part} (budget {budget:.0f} s, {left:.0f} s left) ===", flush=True)
        ts = time.monotonic()
        try:
            if part == "checks":
                from bench import gpu_checks

                gpu_checks.main()
            elif part == "decode":
                from bench import decode

                quick = ["--new-tokens", "64", "--prompts", "code,math"] if a.quick else []
                decode.main(["--max-seconds", str(budget * 0.8)] + quick)
            elif part == "drafters":
                from bench import drafters

                drafters.main(["--max-seconds", str(budget * 0.85), "--repeats", "1" if a.quick else "3"]
                              + (["--new-tokens", "64"] if a.quick else []))
            elif part == "budget":
                from bench import budget as bb

                bb.main(["--max-seconds", str(budget * 0.85)] + (["--contexts", "4096,32768"] if a.quick else
                                                          ["--contexts", "4096,131072,32768,8192,65536,16384"]))
            status[part] = f"ok in {time.monotonic() - ts:.0f} s"
        except Exception as e:  # keep going: the other parts still report
            traceback.print_exc()
            status[part] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
    print("\n=== summary ===")
    d = out_dir()
    for part, s in status.items():
        print(f"{part}: {s}")
    try:
        dec = json.loads((d / "decode.json").read_text())
        for name, t in dec["targets"].items():
            s = t.get("summary", {})
            print(f"decode {name}: strata {s.get('graph_tok_s', 0):.1f} tok/s, eager {s.get('eager_tok_s', 0):.1f}, "
                  f"transformers {s.get('hf_tok_s', 0):.1f} -> x{s.get('ratio_vs_hf', 0):.1f}; "
                  f"{100 * s.get('frac_of_bound', 0):.1f}% of bound ({s.get('bound_tok_s', 0):.0f} tok/s)")
    except Exception as e:
        print(f"decode summary unavailable: {e}")
    try:
        dr = json.loads((d / "drafters.json").read_text())
        for arm, r in dr["arms"].items():
            sp = {t: round(v.get("speedup") or 0, 2) for t, v in r["tasks"].items()}
            eq = all(v.get("equal_to_target_only", True) for v in r["tasks"].values())
            eg = [t for t, v in r["tasks"].items() if v.get("eager_equal") is False]
            print(f"drafter {arm}: speedup {sp}; greedy equal {eq}; eager-path mismatches {eg}")
    except Exception as e:
        print(f"drafters summary unavailable: {e}")
    try:
        bu = json.loads((d / "budget.json").read_text())
        errs = [r.get("error") for r in bu["rows"] if r.get("error") is not None]
        print(f"budget: {len(bu['rows'])} rows, error range {min(errs):+.1%}..{max(errs):+.1%}, "
              f"OOM {sum('oom' in r for r in bu['rows'])}, unfit {sum(r.get('fits') is False for r in bu['rows'])}")
    except Exception as e:
        print(f"budget summary unavailable: {e}")
    print(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
