"""The wizard's VRAM prediction (setup_wizard.budget) against the measured peak, for contexts 4k-128k and each drafter.

    python bench/budget.py [--contexts 4096,8192,...] [--max-seconds 120]

For each (context, drafter): the budget with the GPU's free memory, the expert slots it chooses, then, in a fresh
process (so nothing of an earlier row is counted and the process's one-time allocations, such as cuBLAS workspaces,
are), an engine built with those slots, a prompt filling the context (context - 8 tokens) prefilled and 4 tokens
decoded, then on a short prompt a longer greedy generation and sampled ones (drafting and the target alone) at as
many sampling settings as the graphs are kept for, so every graph the budget counts is made, and the peak
`torch.cuda.max_memory_reserved` (the allocator's reservation, graph pools included; the CUDA context itself is
outside it).
`predicted` = every budget item except `headroom` and `reserve` (they are slack, not allocations) + the expert
cache; `error` = (predicted - measured) / measured; `fits` = measured <= predicted + headroom (no out-of-memory).
Also the runtime's own `Engine.memory_report()` total (persistent buffers only), the reservation right after the
build, where the reservation sits at the end (segments by stream, pool and type: graph pools have their own pool
id), and a check of the chunked-prefill attention on the GPU (equal to the mask path; extra peak at 128k).
Rows run context by context in the order given (default 4k, 128k, 32k, 8k) so a timeout loses the least needed;
the JSON is rewritten after every row. `--rescore saved.json` scores the current budget code against a saved run's
measured peaks on the CPU.

    python bench/budget.py --a3b [--caps 12,16,24] [--contexts 4096,131072,32768,8192,65536] [--max-seconds 300]

`--a3b`: the Qwen3-30B-A3B shape (random BF16 weights, experts in a pinned host arena, built once) on cards of
`--caps` GiB: for each (cap, context) the budget with `available = total = cap`, then, in this process under that
cap (`--vram-limit-mib`'s mechanism: the allocator refuses to reserve past it), the engine's allocations (dense
weights, the expert slot pool the budget sized, KV cache, logits buffer, graphed step), the last two prefill chunks
of a prompt filling the context and 4 decoded tokens, and the peak `torch.cuda.max_memory_reserved`. A chunk's peak
does not depend on where it sits in the context (static KV cache, flash attention), so the first
`context - 8 - 1024` positions are left as zeros rather than computed (a full 128k prefill with most experts off the
GPU would take minutes). Rows the budget says do not fit are reported, not run. Between rows the cuBLAS workspaces
and cached segments are released, so each row starts as a fresh process would (the dense weights stay: they are the
first allocations of every row and count in its peak).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, NANO_DFLASH2, Deadline, machine, print_table, write_json  # noqa: E402
from runtime.drafters.dflash2.contract import DFlash2Geometry  # noqa: E402
from runtime.memory import cap_device_memory  # noqa: E402
from runtime.models.target_config import TargetGeometry  # noqa: E402

MIB = 1 << 20


def inventory(folder: Path) -> dict[str, int]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt", device="cpu") as sf:
            for k in sf.keys():
                n = 1
                for d in sf.get_slice(k).get_shape():
                    n *= int(d)
                out[k] = n
    return out


def predict(kind: str, quant: str, context: int, free: int, total: int,
            capability: tuple[int, int] | None = None) -> Any:
    from setup_wizard import budget as B

    geo = TargetGeometry.from_config(json.loads((NANO / "config.json").read_text())).with_inventory(inventory(NANO))
    dgeo = DFlash2Geometry.from_config(json.loads((NANO_DFLASH2 / "config.json").read_text())) \
        if kind == "dflash2" else None
    from runtime.engine import MTP_DEFAULT_BLOCK

    # the block the measured engine runs (built without one: the kind's default), as setup budgets the configured one
    block = {"none": 1, "mtp": MTP_DEFAULT_BLOCK}.get(kind, dgeo.block_size if dgeo else 1)
    inp = B.BudgetInputs(context=context, block=block, device_type="cuda", available_bytes=free, total_bytes=total,
                         weight_bytes=2, kv_bytes=2, capability=capability,
                         cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    return B.compute_budget(geo, kind, inp, dflash2=dgeo, quant=quant)


def measure(kind: str, path: Path | None, context: int, slots: int) -> dict[str, Any]:
    """One row, in this process (run it in a fresh one: `--row`)."""
    from runtime.engine import Engine

    before = torch.cuda.memory_reserved()
    eng = Engine.build(NANO, kind, drafter_path=path, device="cuda", context=context, expert_slots=slots)
    torch.cuda.synchronize()
    after_build = torch.cuda.memory_reserved() - before
    g = torch.Generator().manual_seed(context)
    ids = torch.randint(2, eng.model.cfg.vocab_size, (context - 8,), generator=g).tolist()
    res = eng.generate(ids, max_new_tokens=4, stop_ids=set())
    # every graph the budget counts, on a short prompt (graphs outlive it): a longer greedy generation (its last
    # windows draft fewer rows: a proposal graph per length), then sampled ones, drafting and the target alone, at
    # as many settings as the graph sets keep (runtime/gpu/capture.py SAMPLED_SETTINGS_KEPT; the sampled
    # acceptance's graphs, runtime.sampling.RULE_GRAPHS_KEPT, for the target alone)
    from runtime.gpu.capture import SAMPLED_SETTINGS_KEPT
    from runtime.sampling import RULE_GRAPHS_KEPT, SamplingParams

    short = ids[:64]
    eng.generate(short, max_new_tokens=24, stop_ids=set())
    for i in range(RULE_GRAPHS_KEPT if kind == "none" else SAMPLED_SETTINGS_KEPT):
        sp = SamplingParams(temperature=0.6 + 0.1 * i, top_p=0.9, seed=i)
        if kind != "none":
            eng.generate(short, max_new_tokens=24, stop_ids=set(), sampling=sp)
        eng.generate(short, max_new_tokens=12, stop_ids=set(), draft=False, sampling=sp)
    torch.cuda.synchronize()
    out = {"peak_reserved": torch.cuda.max_memory_reserved() - before,
           "peak_allocated": torch.cuda.max_memory_allocated(), "baseline_reserved": before,
           "memory_report": eng.memory_report(), "generated": len(res.token_ids),
           "expert_cache": eng.experts.stats(), "reserved_after_build": after_build,
           "segments": segments()}
    out["step_errors"] = list(eng.step.errors) if eng.step is not None else []
    return out


def segments() -> list[dict[str, Any]]:
    """Reserved memory by (stream, pool, segment type): where the reservation went (graph pools have a pool id)."""
    agg: dict[tuple, dict[str, Any]] = {}
    for seg in torch.cuda.memory_snapshot():
        key = (seg.get("stream", 0), str(seg.get("segment_pool_id", "")), seg.get("segment_type", ""))
        a = agg.setdefault(key, {"stream": key[0], "pool": key[1], "type": key[2], "segments": 0, "bytes": 0,
                                 "allocated": 0, "sizes": []})
        a["segments"] += 1
        a["bytes"] += seg["total_size"]
        a["allocated"] += seg.get("allocated_size", 0)
        a["sizes"].append(seg["total_size"])
    return list(agg.values())


def check_attention() -> dict[str, Any]:
    """The chunked-prefill attention on this GPU: equal to the boolean-mask path, and its peak extra memory at
    128k (a [chunk x context] score tensor per head would be ~0.5 GiB; flash needs a few MiB)."""
    import torch.nn.functional as F

    from runtime.models.layers import cached_attention

    out: dict[str, Any] = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for S in (4096 + 512, 131072):
        q = torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 2, S, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, 2, S, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        new = cached_attention(q, k, v, 0.125)
        torch.cuda.synchronize()
        out[f"extra_peak_mib_{S}"] = (torch.cuda.max_memory_allocated() - base) / MIB
        if S < 10000:
            mask = torch.arange(S, device="cuda")[None, :] <= torch.arange(S - 512, S, device="cuda")[:, None]
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125,
                                                 enable_gqa=True)
            out["max_abs_diff_vs_fp32_mask"] = float((new.float() - ref).abs().max())
        del q, k, v, new
    return out


def measure_fresh(kind: str, path: Path | None, context: int, slots: int, timeout: float,
                  limit_mib: int | None = None) -> dict[str, Any]:
    """`measure` in a fresh Python process (its JSON comes back on the last stdout line)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", json.dumps([kind, str(path or ""), context, slots])]
    if limit_mib is not None:
        cmd += ["--vram-limit-mib", str(limit_mib)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 5))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout)[-400:]
        if "OutOfMemoryError" in tail:
            raise torch.OutOfMemoryError(tail)
        raise RuntimeError(f"row process failed: {tail}")
    return json.loads(lines[-1][4:])


def rescore(path: Path) -> dict[str, Any]:
    """The current prediction for each measured row of a saved run (same free memory, capability and slots input),
    against that run's measured peak. Written next to it as `<name>.rescored.json`."""
    saved = json.loads(path.read_text())
    cap = tuple(int(x) for x in str(saved.get("machine", {}).get("capability", "9.0")).split("."))
    out: dict[str, Any] = {"source": str(path), "rows": []}
    rows = []
    for r in saved["rows"]:
        if "peak_reserved" not in r:
            continue
        kind, _, quant = r["drafter"].partition(" ")
        b = predict(kind, quant or "bf16", r["context"], r["budget"]["available_bytes"], r["budget"]["total_bytes"],
                    cap)  # type: ignore[arg-type]
        items = b.table()
        pred = sum(v for k, v in items.items() if k not in ("headroom", "reserve"))
        m = r["peak_reserved"]
        rec = {"context": r["context"], "drafter": r["drafter"], "predicted": pred, "measured": m,
               "error": (pred - m) / m, "fits": m <= pred + items["headroom"], "items": items,
               "predicted_in_run": r.get("predicted")}
        out["rows"].append(rec)
        rows.append([r["context"], r["drafter"], pred / MIB, m / MIB, 100 * rec["error"], rec["fits"]])
    print_table(f"VRAM budget (current code) vs measured peak of {path.name}",
                ["context", "drafter", "predicted MiB", "measured MiB", "error %", "fits"], rows)
    dst = path.with_suffix(".rescored.json")
    dst.write_text(json.dumps(out, indent=1))
    return out


def a3b_rows(args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    """The A3B rows (see the module docstring)."""
    import time

    from bench.common import A3B_SHAPE, build_random_a3b
    from runtime.engine import Engine
    from runtime.experts import ExpertCache
    from runtime.kv import KVCache
    from runtime.speculative import prefill
    from setup_wizard import budget as B

    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "shape": "qwen3-30b-a3b", "rows": []}
    t0 = time.perf_counter()
    model, arena = build_random_a3b(A3B_SHAPE, experts="arena")
    torch.cuda.synchronize()
    res["build_s"] = time.perf_counter() - t0
    res["arena"] = {"bytes": arena.nbytes, "pinned": arena.pinned}
    geo = TargetGeometry.from_config(A3B_SHAPE)
    cap_dev = tuple(torch.cuda.get_device_capability())
    total_dev = torch.cuda.get_device_properties(0).total_memory
    g = torch.Generator().manual_seed(3)
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for gib in [int(c) for c in args.caps.split(",")]:
            if deadline.over():
                res["truncated"] = True
                break
            cap = gib << 30
            inp = B.BudgetInputs(context=ctx, block=1, device_type="cuda", available_bytes=cap, total_bytes=cap,
                                 weight_bytes=2, kv_bytes=2, prefill_chunk=512, capability=cap_dev,
                                 cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
            b = B.compute_budget(geo, "none", inp)
            rec: dict[str, Any] = {"context": ctx, "cap_gib": gib, "budget": b.to_dict()}
            if not b.fits:
                rec["fits_budget"] = False
                rows.append([ctx, gib, "-", None, None, None, "does not fit"])
                res["rows"].append(rec)
                continue
            gc.collect()
            torch.cuda.empty_cache()
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(cap / total_dev)
            torch.cuda.reset_peak_memory_stats()
            cache = eng = None
            try:
                cache = ExpertCache(model, torch.device("cuda"), b.expert_cache_slots, arena=arena)
                cache.place(model)
                cfg = model.cfg
                kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, ctx,
                             dtype=torch.bfloat16, device="cuda")
                cache.ensure_window(1)
                eng = Engine(model=model, tokenizer=None, kv=kv, drafter=None, drafter_kind="none", experts=cache,
                             device=torch.device("cuda"), block=1, spec_min_p=0.0, stop_ids=set(),
                             target_dir=Path("."))
                step = eng.static_step()
                n = min(1024, ctx - 8)
                ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                with torch.no_grad():
                    kv.length = ctx - 8 - n
                    tok = int(torch.argmax(prefill(model, kv, ids, (), 512)))
                    for _ in range(4):
                        tok = int(torch.argmax(step(torch.tensor([[tok]], device="cuda"), kv).logits[0, -1]))
                torch.cuda.synchronize()
                m = torch.cuda.max_memory_reserved()
                items = b.table()
                pred = sum(v for k, v in items.items() if k not in ("headroom", "reserve"))
                rec.update(peak_reserved=m, predicted=pred, error=(pred - m) / m, fits=m <= cap,
                           slots=b.expert_cache_slots, dynamic_slots=b.dynamic_slots,
                           memory_report=eng.memory_report(), expert_cache=cache.stats(), segments=segments(),
                           graph=step.use_graph, step_errors=list(step.errors))
                rows.append([ctx, gib, b.expert_cache_slots, pred / MIB, m / MIB, 100 * rec["error"], rec["fits"]])
            except torch.OutOfMemoryError as e:
                rec["oom"] = str(e)[:300]
                rows.append([ctx, gib, b.expert_cache_slots, None, None, None, "OOM"])
            finally:
                if cache is not None:
                    cache.release()
                del eng
                kv = step = None
                torch.cuda.set_per_process_memory_fraction(1.0)
            res["rows"].append(rec)
            write_json("budget_a3b.json", res)
            print(f"  ctx {ctx} cap {gib} GiB: " + (f"predicted {rec['predicted'] / MIB:.1f} MiB, measured "
                  f"{rec['peak_reserved'] / MIB:.1f} MiB ({100 * rec['error']:+.2f}%)" if "predicted" in rec
                  else rec.get("oom", "not run")), flush=True)
    print_table(f"VRAM budget vs measured peak, A3B shape under a cap, on {res['machine'].get('gpu')}",
                ["context", "cap GiB", "expert slots", "predicted MiB", "measured MiB", "error %", "fits"], rows)
    errs = [abs(r["error"]) for r in res["rows"] if "error" in r]
    res["max_abs_error"] = max(errs) if errs else None
    res["ooms"] = [f"{r['context']}@{r['cap_gib']}" for r in res["rows"] if "oom" in r or r.get("fits") is False]
    print(f"  max |error| {100 * (res['max_abs_error'] or 0):.2f}% (goal <= 2%), out of memory: {res['ooms'] or 'none'}")
    write_json("budget_a3b.json", res)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default=None,
                    help="in this order (a timeout loses the last ones); default 4096,1024,2048 (the pack's "
                         "maximum is 4096: strata refuses longer contexts) (--a3b: 4096,131072,32768,8192,65536)")
    ap.add_argument("--a3b", action="store_true", help="the A3B shape under --caps GiB caps (see above)")
    ap.add_argument("--caps", default="12,16,24", help="--a3b: card sizes in GiB")
    ap.add_argument("--vram-limit-mib", type=int, default=None,
                    help="cap every row's GPU memory (and budget against it), as strata-run --vram-limit-mib does")
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rescore", default=None, metavar="BUDGET_JSON",
                    help="no GPU: score the current budget code against the peaks measured in a saved budget.json")
    args = ap.parse_args(argv)
    if args.rescore is not None:
        return rescore(Path(args.rescore))
    if args.row is not None:                      # child: one measurement, printed as JSON
        cap_device_memory(args.vram_limit_mib)
        kind, path, ctx, slots = json.loads(args.row)
        print("ROW " + json.dumps(measure(kind, Path(path) if path else None, int(ctx), int(slots))), flush=True)
        return {}
    if not torch.cuda.is_available():
        raise SystemExit("bench/budget.py needs a CUDA GPU.")
    deadline = Deadline(args.max_seconds)
    if args.a3b:
        args.contexts = args.contexts or "4096,131072,32768,8192,65536"
        return a3b_rows(args, deadline)
    args.contexts = args.contexts or "4096,1024,2048"
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "rows": []}
    cap = tuple(torch.cuda.get_device_capability())
    try:
        res["attention_check"] = check_attention()
    except Exception as e:  # noqa: BLE001 - recorded, the rows still run
        res["attention_check"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    print(f"  attention check: {res['attention_check']}", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    rows = []
    with tempfile.TemporaryDirectory() as td:
        drafters: list[tuple[str, str, str, Path | None]] = [("none", "none", "bf16", None), ("mtp", "mtp", "bf16", None),
                                                             ("dflash2 bf16", "dflash2", "bf16", NANO_DFLASH2)]
        try:
            from setup_wizard.convert import convert_dflash2

            convert_dflash2(NANO_DFLASH2, "q4_0", Path(td) / "q4_0.gguf")
            drafters.append(("dflash2 q4_0", "dflash2", "q4_0", Path(td) / "q4_0.gguf"))
        except ImportError as e:
            print(f"no q4_0 row: {e}", flush=True)
        for ctx in [int(c) for c in args.contexts.split(",")]:
            for label, kind, quant, path in drafters:
                if deadline.over():
                    res["truncated"] = True
                    break
                gc.collect()
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info()
                free += torch.cuda.memory_reserved()      # what this (parent) process holds is free for the row
                if args.vram_limit_mib is not None:       # a capped card: the cap is all there is
                    free = total = min(free, args.vram_limit_mib * MIB)
                b = predict(kind, quant, ctx, free, total, cap)
                rec: dict[str, Any] = {"context": ctx, "drafter": label, "budget": b.to_dict()}
                try:
                    m = measure_fresh(kind, path, ctx, b.expert_cache_slots, deadline.left(), args.vram_limit_mib)
                    rec.update(m)
                    items = b.table()
                    pred = sum(v for k, v in items.items() if k not in ("headroom", "reserve"))
                    rec["predicted"] = pred
                    rec["error"] = (pred - m["peak_reserved"]) / m["peak_reserved"]
                    rec["fits"] = m["peak_reserved"] <= pred + items.get("headroom", 0)
                    rec["report_total"] = sum(m["memory_report"].values())
                    rows.append([ctx, label, b.expert_cache_slots, pred / MIB, m["peak_reserved"] / MIB,
                                 100 * rec["error"], rec["fits"], rec["report_total"] / MIB])
                except (torch.OutOfMemoryError, RuntimeError, subprocess.TimeoutExpired) as e:
                    failed = "OOM" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
                    rec["oom" if failed == "OOM" else "failed"] = str(e)[:300]
                    rows.append([ctx, label, b.expert_cache_slots, None, None, None, failed, None])
                res["rows"].append(rec)
                write_json("budget.json", res)          # after every row: a timeout keeps what was measured
                print(f"  ctx {ctx} {label}: " + (f"predicted {rec.get('predicted', 0) / MIB:.1f} MiB, measured "
                      f"{rec.get('peak_reserved', 0) / MIB:.1f} MiB" if "predicted" in rec else "no measurement"),
                      flush=True)
    print_table(f"VRAM budget vs measured peak, strata-nano on {res['machine'].get('gpu')}",
                ["context", "drafter", "expert slots", "predicted MiB", "measured MiB", "error %", "fits",
                 "runtime report MiB"], rows)
    write_json("budget.json", res)
    return res


if __name__ == "__main__":
    main()
