"""Target-only vs MTP vs DFlash2 (BF16, Q8_0, Q5_0, Q4_0) on the bundled pack, on the four calibration task prompts.

    python bench/drafters.py [--new-tokens 128] [--repeats 3] [--max-seconds 120]

For each arm and task: median decode tok/s over repeats, speed-up over target-only (timed between the arm's own
repeats, so that a drifting machine moves both sides alike), tokens committed per window
(accepted + 1), draft ms and verify ms per window. The GGUF quantizations are converted from the bundled BF16
drafter on the fly (setup_wizard.convert; needs the `gguf` package, else those rows are skipped). On a CPU each MTP
arm runs twice: its chain eager, and ` compiled` (the head's step compiled ahead of time, runtime/drafters/
mtp_compiled.py; built into the store's compiled/ on first use, about 15 s), and target-only and the compiled MTP
arms and DFlash2 BF16 once more with the target's step compiled too (", target compiled": runtime/target_compiled.py,
about 45 s to build once), and those drafted arms again with the wide step's attention as torch ops (", torch-op
attention": the attention before runtime/cpu_ops.py's op, what a machine that cannot build it runs), and the
compiled MTP arms with the chain's int8 head through torch's kernel (", torch int8 head": before the C++ head).
Also the greedy-equality check of docs/models.md ("Speculative decoding") in BF16 on the GPU: every drafted arm's tokens against target-only
tokens of the same engine (the fixed-width step: runtime/static_step.py), and, for contrast, the plain eager path
(no static step: a 1-row decode vs k-row verify in cuBLAS/SDPA) — `eager mismatches` counts prompts that differ there.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    NANO,
    NANO_DFLASH2,
    Deadline,
    machine,
    median,
    print_table,
    task_prompts,
    write_json,
)
from runtime import target_compiled  # noqa: E402
from runtime.drafters import head8  # noqa: E402

EAGER_ARMS = ("MTP b4", "DFlash2 bf16")


def arms(gguf_dir: Path | None, dflash_blocks: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    mtp = [{"arm": "MTP b4", "kind": "mtp", "path": None, "block": 4, "min_p": 0.0},
           {"arm": "MTP b3", "kind": "mtp", "path": None, "block": 3, "min_p": 0.0},
           {"arm": "MTP b5", "kind": "mtp", "path": None, "block": 5, "min_p": 0.0},
           {"arm": "MTP b6 p.5", "kind": "mtp", "path": None, "block": 6, "min_p": 0.5}]
    # on a CPU the MTP chain's step compiled ahead of time (runtime/drafters/mtp_compiled.py): each arm both ways
    out = [{"arm": "target-only", "kind": "none", "path": None, "block": 1, "min_p": 0.0},
           *(dict(a, compiled=False) for a in mtp), *(dict(a, arm=a["arm"] + " compiled", compiled=True) for a in mtp),
           {"arm": "DFlash2 bf16", "kind": "dflash2", "path": NANO_DFLASH2, "block": None, "min_p": 0.0}]
    # and the target's fixed-width step compiled too (runtime/target_compiled.py): target-only and the MTP arms
    # again with ", target compiled" (the other arms run the eager target step)
    out += [dict(a, arm=a["arm"] + ", target compiled", target=True) for a in out
            if a["kind"] == "none" or a.get("compiled") or a["arm"] == "DFlash2 bf16"]
    # and the drafted ones once more with the wide step's attention as torch ops (runtime/cpu_ops.py: what a
    # package takes where the C++ op cannot be built; the attention before the op)
    out += [dict(a, arm=a["arm"] + ", torch-op attention", attn_op=False) for a in out
            if a.get("target") and a["kind"] != "none"]
    # and the compiled MTP arms with the chain's int8 head through torch's kernel (runtime/drafters/head8.py
    # USE_OP: before the C++ int8 head)
    out += [dict(a, arm=a["arm"] + ", torch int8 head", head_op=False) for a in out
            if a.get("target") and a.get("compiled") and "torch-op" not in a["arm"]]
    out += [{"arm": f"DFlash2 bf16 b{b}", "kind": "dflash2", "path": NANO_DFLASH2, "block": b, "min_p": 0.0}
            for b in dflash_blocks]
    if gguf_dir is not None:
        for q in ("q8_0", "q5_0", "q4_0"):
            out.append({"arm": f"DFlash2 {q}", "kind": "dflash2", "path": gguf_dir / f"{q}.gguf", "block": None,
                        "min_p": 0.0})
    return out


def convert_ggufs(tmp: Path) -> Path | None:
    try:
        import gguf  # noqa: F401

        from setup_wizard.convert import convert_dflash2
    except ImportError as e:
        print(f"no GGUF rows: {e}", flush=True)
        return None
    for q in ("q8_0", "q5_0", "q4_0"):
        convert_dflash2(NANO_DFLASH2, q, tmp / f"{q}.gguf")
    return tmp


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_arm(eng, arm: dict, prompts: dict[str, list[int]], args, deadline: Deadline) -> dict[str, Any]:
    from runtime.speculative import generate_ids

    block = arm["block"] if arm["block"] is not None else (eng.drafter.max_block if eng.drafter else 1)
    draft = arm["kind"] != "none"
    res: dict[str, Any] = {"block": block, "min_p": arm["min_p"], "tasks": {}}
    for task, ids in prompts.items():
        if deadline.over():
            res["truncated"] = True
            break
        # one step width for the arm and its target-only reference (the engine's step follows the block: greedy bits
        # are equal between runs of one width, docs/models.md "Numerics"); target-only itself runs at width 1
        kw = dict(max_new_tokens=args.new_tokens, block=block, spec_min_p=arm["min_p"], stop_ids=set(), width=block)
        eng.generate(ids, draft=draft, **{**kw, "max_new_tokens": 8})          # warm-up (graph capture)
        # a drafted arm also times the target alone (width 1, as the target-only arm runs) between its own
        # repeats: the speed-up is against that, so a machine whose speed drifts during the run (a shared VM)
        # moves both sides alike
        alone = dict(kw, block=1, width=1)
        if draft:
            eng.generate(ids, draft=False, **{**alone, "max_new_tokens": 8})
        runs, cpu_tok_s, ref_tok_s = [], [], []
        for _ in range(args.repeats):
            for arm_run in ((True, False) if draft else (False,)):
                akw = kw if arm_run else alone
                c0 = time.process_time()
                r = eng.generate(ids, draft=arm_run, **akw)
                rate = r.stats["decode_tok_s"]
                if args.clock == "process":
                    c1 = time.process_time()
                    eng.generate(ids, draft=arm_run, **{**akw, "max_new_tokens": 1})      # the prompt alone
                    rate = (len(r.token_ids) - 1) / max((c1 - c0) - (time.process_time() - c1), 1e-9)
                if arm_run or not draft:
                    runs.append(r)
                    cpu_tok_s.append(rate)
                else:
                    ref_tok_s.append(rate)
        st = [r.stats for r in runs]
        rec: dict[str, Any] = {
            # --clock process: decode tokens per second of this process's CPU time (the whole generation minus a
            # prompt-only one): on a shared machine the wall clock also counts time the scheduler gave others
            "tok_s": median(cpu_tok_s),
            "wall_tok_s": median([s["decode_tok_s"] for s in st]),
            "tok_per_window": median([(s["generated_tokens"] - 1) / max(s["windows"], 1) for s in st]),
            # the drafter's time in the windows (its share of the prompt, `observe_prompt_s`, is the prompt's)
            "draft_ms_per_window": median([1e3 * s.get("draft_window_s", s["draft_s"]) / max(s["windows"], 1)
                                           for s in st]),
            "verify_ms_per_window": median([1e3 * s["verify_s"] / max(s["windows"], 1) for s in st]),
            "accept_rate": median([s["accepted"] / max(s["proposed"], 1) for s in st]),
            "tokens": runs[0].token_ids,
        }
        if ref_tok_s:
            rec["target_tok_s_interleaved"] = median(ref_tok_s)
        if draft:
            ref = eng.generate(ids, draft=False, **kw).token_ids               # target-only, same engine
            rec["equal_to_target_only"] = runs[0].token_ids == ref
            rec["first_diff"] = first_diff(runs[0].token_ids, ref)
            if args.eager_check and eng.drafter is not None and task == "code" and arm["arm"] in EAGER_ARMS:
                # the plain path (no fixed-width step, no kernels: the runtime before the fast path): does a k-row
                # verify flip a near-tie of the 1-row decode there?
                from runtime.gpu import kernels

                kernels.ENABLED = False
                try:
                    n_eager = min(args.new_tokens, 48)    # the eager path is slow: a shorter run
                    plain_ref = generate_ids(eng.model, eng.kv, ids, max_new_tokens=n_eager, stop_ids=set())
                    graphs, eng.drafter.graphs = eng.drafter.graphs, None
                    try:
                        plain = generate_ids(eng.model, eng.kv, ids, drafter=eng.drafter, block=block,
                                             spec_min_p=arm["min_p"], max_new_tokens=n_eager, stop_ids=set())
                    finally:
                        eng.drafter.graphs = graphs
                finally:
                    kernels.ENABLED = True
                rec["eager_equal"] = plain.token_ids == plain_ref.token_ids
                rec["eager_first_diff"] = first_diff(plain.token_ids, plain_ref.token_ids)
        res["tasks"][task] = rec
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--no-eager-check", dest="eager_check", action="store_false")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default="", help="comma-separated substrings of arm names to run (default: all)")
    ap.add_argument("--exact", action="store_true",
                    help="--only names whole arms, separated by ';' (arm names hold commas)")
    ap.add_argument("--tasks", default="", help="comma-separated task prompts (default: all four)")
    ap.add_argument("--clock", choices=("wall", "process"), default="wall",
                    help="process: tok/s from this process's CPU time (1-thread CPU runs on a shared machine)")
    ap.add_argument("--dflash-blocks", default="", help="extra DFlash2 BF16 arms at these blocks, e.g. 4,6")
    args = ap.parse_args(argv)
    from runtime.engine import Engine

    deadline = Deadline(args.max_seconds)
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "arms": {}}
    if not (NANO / "model.safetensors").is_file():
        raise SystemExit(f"the bundled pack is missing ({NANO}); nothing to measure.")
    with tempfile.TemporaryDirectory() as td:
        gdir = convert_ggufs(Path(td))
        prompts: dict[str, list[int]] | None = None
        engines: dict[tuple, Any] = {}
        wanted = [w.strip() for w in args.only.split(";" if args.exact else ",") if w.strip()]
        for arm in arms(gdir, tuple(int(b) for b in args.dflash_blocks.split(",") if b)):
            hit = arm["arm"] in wanted if args.exact else any(w in arm["arm"] for w in wanted)
            if wanted and not arm["arm"].startswith("target-only") and not hit:
                continue
            if deadline.over():
                break
            key = (arm["kind"], str(arm["path"]))
            if key not in engines:
                engines.clear()
                gc.collect()
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                engines[key] = Engine.build(NANO, arm["kind"], drafter_path=arm["path"], device=args.device,
                                            context=4096)
            eng = engines[key]
            if args.device == "cpu":     # the target step compiled (built once into the store) or eager
                target_compiled._OP_MODES["wide"] = arm.get("attn_op", True)
                head8.USE_OP = arm.get("head_op", True)
                arm["target_why"] = eng.compile_target(build=True) if arm.get("target") else "eager arm"
                if not arm.get("target"):
                    eng.target_packages = {}
                elif eng.target_why:
                    print(f"  {arm['arm']}: skipped ({eng.target_why})", flush=True)
                    continue
            elif arm.get("target"):
                continue
            if arm["kind"] == "mtp":
                if arm["compiled"] and args.device == "cpu":
                    arm["compiled_why"] = eng.compile_drafter(build=True)   # built once into the store, then loaded
                else:
                    eng.drafter.compiled = None
                if arm["compiled"] and not eng.drafter_compiled:
                    print(f"  {arm['arm']}: skipped ({arm.get('compiled_why') or 'a CPU arm'})", flush=True)
                    continue
            if prompts is None:
                tasks = [t for t in args.tasks.split(",") if t]
                prompts = {k: eng.tokenizer.encode(v).ids for k, v in task_prompts().items() if not tasks or k in tasks}
                res["prompt_tokens"] = {k: len(v) for k, v in prompts.items()}
            r = run_arm(eng, arm, prompts, args, deadline)
            r["drafter_compiled"] = eng.drafter_compiled if eng.drafter is not None else None
            if eng.drafter is not None and hasattr(eng.drafter, "memory_report"):
                r["drafter_memory"] = eng.drafter.memory_report()
            st = eng.step
            r["target_step"] = None if st is None else {"width": st.width, "graph": getattr(st, "use_graph", False),
                                                         "fused": getattr(st, "fused", False), "errors": st.errors,
                                                         "compiled": type(st).__name__ == "CompiledTargetStep"}
            dg = getattr(eng.drafter, "graphs", None)
            r["drafter_graphs"] = None if dg is None else {"enabled": dg.enabled, "replays": dg.replays,
                                                           "errors": dg.errors}
            res["arms"][arm["arm"]] = r
            print(f"  {arm['arm']}: " + ", ".join(f"{t} {v['tok_s']:.0f} tok/s" for t, v in r["tasks"].items()),
                  flush=True)
        engines.clear()
    base = res["arms"].get("target-only", {}).get("tasks", {})
    rows = []
    for name, r in res["arms"].items():
        for task, v in r["tasks"].items():
            b = base.get(task, {}).get("tok_s")
            b = v.get("target_tok_s_interleaved", b)      # the target alone timed between this arm's repeats
            v["speedup"] = v["tok_s"] / b if b else None
            same_tgt = (v["tokens"] == base.get(task, {}).get("tokens")) if base.get(task) else None
            rows.append([name, task, v["tok_s"], v["speedup"], v["tok_per_window"], v["draft_ms_per_window"],
                         v["verify_ms_per_window"], v.get("equal_to_target_only", "-"), v.get("eager_equal", "-"),
                         same_tgt])
    print_table(f"drafters on strata-nano, {res['machine'].get('gpu') or 'cpu'} (medians of {args.repeats}, "
                f"{args.new_tokens} new tokens, greedy)",
                ["arm", "task", "tok/s", "x target", "tok/window", "draft ms/win", "verify ms/win",
                 "== target-only", "eager ==", "== none-engine"], rows)
    for r in res["arms"].values():
        for v in r["tasks"].values():
            v.pop("tokens", None)
    write_json("drafters.json", res)
    return res


if __name__ == "__main__":
    main()
