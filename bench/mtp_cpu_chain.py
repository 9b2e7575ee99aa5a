"""The MTP drafter's chain on a CPU: its eager rows against its step compiled ahead of time
(runtime/drafters/mtp_compiled.py), side by side in one process, on the bundled pack.

    OMP_NUM_THREADS=1 python bench/mtp_cpu_chain.py [--task code] [--drafts 1,3,5] [--rounds 8] [--calls 60]

For each chain length: `MTPDrafter.propose` of that many drafts at the prompt's end (no floor, greedy), with the
compiled step attached and without, alternating for `rounds` rounds; median ms of process time per call. Also the
compiled step alone (one row), whether both chains draft the same tokens, and the bound: the bytes one compiled
chained step must read (the head's layer with its k routed experts, fc, in int8 where the step takes them so, the
int8 vocabulary head, an embedding row, the head's cache up to the prompt) at this machine's one-thread copy bandwidth of a buffer that size (measured here:
a chain rereads those few MB every step, so they stay in cache; the DRAM copy bandwidth is reported beside it). The package is built
into the store's compiled/ on first use ($STRATA_HOME; about 15 s). Writes `mtp_cpu_chain.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, copy_bandwidth, machine, median, print_table, task_prompts, write_json  # noqa: E402


def step_bytes(eng, context: int) -> int:
    """What one chained step reads at least: every weight its one row touches, once, and the cache it attends."""
    d = eng.drafter
    mtp, cfg = d.mtp, eng.model.cfg
    layer = mtp.layers[0]
    mlp = layer.mlp
    a = layer.self_attn
    el = layer.input_layernorm.weight.element_size()
    H = cfg.hidden_size
    experts = mlp.top_k * 3 * H * mlp.inter + H * mlp.n_exp
    head = sum(t.numel() * t.element_size() for t in d.head8) if d.head8 is not None else cfg.vocab_size * H * el
    cache = 2 * a.nkv * a.hd * context * d.kv.k.element_size()
    if d.dense8 is not None:          # the compiled step's int8 fc, q/k/v and o_proj with their scales
        dense = sum(t.numel() * t.element_size() for t in d.dense8[:6])
    else:
        dense = (H * (a.nh + 2 * a.nkv) * a.hd + a.nh * a.hd * H + 2 * H * H) * el
    if d.dense8 is not None and len(d.dense8) > 6:      # ... and its experts' int8 rows: k of the E read
        experts = sum(t.numel() * t.element_size() for t in d.dense8[6:]) * mlp.top_k // mlp.n_exp + H * mlp.n_exp * el
    else:
        experts *= el
    return experts + H * el + dense + head + cache


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="code")
    ap.add_argument("--drafts", default="1,3,5", help="chain lengths (block - 1)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args(argv)
    from runtime.engine import Engine

    eng = Engine.build(NANO, "mtp", device="cpu", context=4096, block=max(int(n) for n in args.drafts.split(",")) + 1)
    t0 = time.perf_counter()
    why = eng.compile_drafter(build=True)
    build_s = time.perf_counter() - t0
    if why:
        raise SystemExit(f"the compiled step is not available here: {why}.")
    d = eng.drafter
    step = d.compiled
    ids = eng.tokenizer.encode(task_prompts()[args.task]).ids
    first = eng.generate(ids, max_new_tokens=1, stop_ids=set(), spec_min_p=0.0)
    d.flush()
    pos, anchor = d.next_pos, first.token_ids[-1]
    nbytes = step_bytes(eng, pos)
    # a chained step reads the same few MB again and again, so they stay in cache: the bound takes the copy
    # bandwidth of a buffer that size (read + write), and the DRAM figure (256 MB) is reported beside it
    bw = copy_bandwidth(nbytes, repeats=9, device="cpu")
    bw_dram = copy_bandwidth(256 << 20, repeats=5, device="cpu")
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "threads": torch.get_num_threads(),
                           "context": pos, "build_or_load_s": round(build_s, 2), "copy_bandwidth_gbs": bw / 1e9,
                           "dram_copy_bandwidth_gbs": bw_dram / 1e9,
                           "step_bytes": nbytes, "bound_step_ms": nbytes / bw * 1e3, "rows": []}
    table = []
    for n in [int(x) for x in args.drafts.split(",") if x]:
        def propose(compiled: bool, n=n) -> torch.Tensor:
            d.compiled = step if compiled else None
            d.kv.length = pos - 1
            return d.propose(anchor, pos, n, min_p=0.0).tokens.clone()
        same = bool(torch.equal(propose(True), propose(False)))
        ts: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for compiled in (False, True):
                c0 = time.process_time()
                for _ in range(args.calls):
                    propose(compiled)
                ts[compiled].append((time.process_time() - c0) / args.calls * 1e3)
        row = {"drafts": n, "eager_ms": median(ts[False]), "compiled_ms": median(ts[True]), "same_drafts": same}
        res["rows"].append(row)
        table.append([n, f"{row['eager_ms']:.3f}", f"{row['compiled_ms']:.3f}",
                      f"{row['eager_ms'] / row['compiled_ms']:.2f}x", f"{n * res['bound_step_ms']:.3f}", same])
    d.compiled = step
    tok, g = torch.tensor([anchor]), d.last_g[None]
    one: list[float] = []
    for _ in range(args.rounds):
        c0 = time.process_time()
        for _ in range(args.calls):
            step(tok, g, pos - 1)
        one.append((time.process_time() - c0) / args.calls * 1e3)
    res["compiled_step_ms"] = median(one)
    print_table(f"MTP chain on the bundled pack, {args.task} prompt ({pos} tokens), ms per propose (process time, "
                f"median of {args.rounds} interleaved rounds, {torch.get_num_threads()} thread(s)); the compiled step "
                f"alone {res['compiled_step_ms']:.3f} ms, its bound {res['bound_step_ms']:.3f} ms ({nbytes / 1e6:.2f} MB "
                f"at {bw / 1e9:.1f} GB/s, a buffer that size; DRAM {bw_dram / 1e9:.1f})",
                ["drafts", "eager", "compiled", "eager / compiled", "bound", "same drafts"], table)
    write_json("mtp_cpu_chain.json", res)
    return res


if __name__ == "__main__":
    main()
