"""Where a compiled wide CPU step spends its time (the verify window of MTP and DFlash2 on a CPU): the shipped
`wide` package of runtime/target_compiled.py against variants of its forward, each compiled the same way at a
fixed width, on the bundled pack with a real prompt in the cache.

    OMP_NUM_THREADS=1 python bench/cpu_wide_variants.py [--tasks code,long] [--width 4] [--rounds 7]

Variants (each compiled for the width alone, where the shipped package takes 2..16 rows; edits of the shipped
forward's text, and the script stops with the variant's name if the code moved):
- `static width`: the shipped forward as it is (its attention and experts the C++ ops where they are built,
  runtime/cpu_ops.py, its products from bf16 copies of the weights where they are bf16 values);
- `fp32 weights`: the same with the products reading the fp32 weights (before the bf16 copies; every variant
  with torch-op experts below reads fp32 too);
- `torch-op experts`: the experts as before the op: every expert on every row weighted by the routing;
- `torch-op attention`: the attention as it was before the op: scores, mask and softmax as torch ops and the values
  in 128-position chunk products summed in chunk order (what a package takes where the op cannot be built);
- `experts per row` (torch ops): each row's k experts selected by index (views, no gather copy; the width fixed in the
  package) instead of every expert on every row weighted by the routing;
- `values chunk-major` (torch ops): scores, softmax and values laid out by 128-position chunk ([kv heads, chunks, rows,
  positions]) so no transposed copy of the probabilities is made;
- `values in one product` (torch ops): the values as one product over all keys (faster, but its sum order is the BLAS's and
  may change with the key count, so a row's bits could depend on its window: not a candidate, a bound);
- `no attention`: the attention output replaced by a cheap stand-in (a floor: what the rest of the step costs).
Per variant: ms per step (process time, median of interleaved rounds) and its logits against the shipped step's.
Writes `cpu_wide_variants.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import NANO, machine, median, print_table, task_prompts, write_json  # noqa: E402

_EXPERTS = '''                g2 = (h @ gu).view(W, s["E"], 2, inter)
                wd = torch.zeros(W, s["E"], dtype=h.dtype, device=h.device).scatter(1, idx, w)
                act = F.silu(g2[:, :, 0]) * g2[:, :, 1] * wd[:, :, None]
                x = x + act.reshape(W, s["E"] * inter) @ dn'''
_EXPERTS_PER_ROW = '''                rows = []
                for r in range(s["W"]):
                    acc = None
                    for j in range(s["k"]):
                        e = idx[r, j].item()
                        torch._check(e >= 0)
                        torch._check(e < s["E"])
                        g2 = h[r:r + 1] @ gu.select(0, e)
                        y = (F.silu(g2[:, :inter]) * g2[:, inter:]) @ dn.select(0, e) * w[r, j]
                        acc = y if acc is None else acc + y
                    rows.append(acc)
                x = x + torch.cat(rows, 0)'''
_VALUES = '''                pr = torch.softmax(sc, -1).view(nkv, W * grp, N // CHUNK, CHUNK).transpose(1, 2)
                o = torch.matmul(pr, vc[:, :N].reshape(nkv, N // CHUNK, CHUNK, hd)).sum(1)    # in chunk order'''
_ATTENTION = '''                sc = torch.bmm(qg, kc[:, :N].transpose(1, 2)).view(nkv, W, grp, N)
                sc = sc.masked_fill(hide[None, :, None, :], float("-inf")).view(nkv, W * grp, N)
''' + _VALUES
_CHUNK_MAJOR = '''                C = N // CHUNK
                sc = torch.matmul(qg[:, None], kc[:, :N].reshape(nkv, C, CHUNK, hd).transpose(2, 3))
                hc = hide.view(W, C, CHUNK).transpose(0, 1)
                sc = sc.view(nkv, C, W, grp, CHUNK).masked_fill(hc[None, :, :, None, :], float("-inf"))
                sc = sc.view(nkv, C, W * grp, CHUNK)
                ex = torch.exp(sc - sc.amax(dim=(1, 3), keepdim=True))
                pr = ex / ex.sum(dim=(1, 3), keepdim=True)
                o = torch.matmul(pr, vc[:, :N].reshape(nkv, C, CHUNK, hd)).sum(1)'''
_ONE_PRODUCT = '''                o = torch.bmm(torch.softmax(sc, -1), vc[:, :N])'''
_NONE = '''                o = qg * kc[:, :1] + hide.sum() * 0'''

# name -> (edits of runtime/target_compiled.py's text, what the variant's shape names: its attention and experts)
VARIANTS = {
    "static width": ([], {}),
    "fp32 weights (before the bf16 copies)": ([], {"w16": False}),
    "torch-op attention (chunked; before the op)": ([], {"attn": "torch"}),
    "torch-op experts (every expert on every row; before the op)": ([], {"moe": "torch"}),
    "experts per row (torch ops)": ([(_EXPERTS, _EXPERTS_PER_ROW)], {"moe": "torch"}),
    "values chunk-major (torch ops)": ([(_ATTENTION, _CHUNK_MAJOR)], {"attn": "torch"}),
    "values in one product (not row-invariant)": ([(_VALUES, _ONE_PRODUCT)], {"attn": "torch"}),
    "no attention (floor)": ([(_ATTENTION, _NONE)], {"attn": "torch"}),
}


def variant_module(edits: list[tuple[str, str]], name: str) -> types.ModuleType:
    """runtime/target_compiled.py with `edits` applied to its text, as a module of its own."""
    from runtime import target_compiled as tc

    src = Path(tc.__file__).read_text()
    for old, new in edits:
        if old not in src:
            raise SystemExit(f"variant {name!r}: its snippet is no longer in runtime/target_compiled.py; update "
                             "this script.")
        src = src.replace(old, new)
    mod = types.ModuleType(f"wide_{abs(hash(name))}")
    mod.__dict__["__file__"] = tc.__file__
    exec(compile(src, tc.__file__, "exec"), mod.__dict__)
    return mod


def compile_variant(mod, model, kv, width: int, per_row: bool, names: dict, home: Path):
    """The variant's step exported and compiled at `width` rows (weights and cache as inputs, as shipped)."""
    from torch.export import Dim

    from runtime import aoti

    mode = "one" if per_row else "wide"          # per-row experts read the per-expert weight layout
    # the bf16 copies go with the experts op: a variant with torch-op experts or named fp32 takes fp32 throughout
    mod.W16 = names.get("w16", True) and names.get("moe") != "torch"
    shape = mod.shape_of(model, kv, "wide", ())
    shape["mode"], shape["W"] = "wide", width
    shape.update(names)
    inputs = mod._Inputs(model, kv, mode)
    L = shape["L"]
    args = mod._structured(inputs.args(torch.zeros(width, dtype=torch.long), torch.arange(130, 130 + width), 130,
                                       width), L)
    S = Dim("start2", min=2, max=shape["capacity"] + 1)
    C = Dim("chunks", min=2, max=shape["slots"] // mod.CHUNK - 1)
    dyn = (None, None, {0: S}, {0: C}, [None] * L, [None] * L, [None] * 4, [None] * len(args[7]))
    ep = aoti.export(mod._Step(shape), args, dyn)
    path = home / f"variant-{abs(hash(str(shape)))}-{time.monotonic_ns()}.pt2"
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return torch._inductor.aoti_load_package(str(path)), inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="code,long")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100, help="step calls a round")
    a = ap.parse_args()
    os.environ["STRATA_COMPILE"] = "1"
    home = Path(tempfile.mkdtemp(prefix="strata-wide-"))
    os.environ["STRATA_HOME"] = str(home)
    from tokenizers import Tokenizer

    from runtime.engine import Engine

    W = a.width
    out: dict = {"machine": machine(), "args": vars(a), "threads": torch.get_num_threads(), "tasks": {}}
    rows = []
    for task in a.tasks.split(","):
        prompt = task_prompts()[task]
        ctx = max(1024, 1 << (len(Tokenizer.from_file(str(NANO / "tokenizer.json")).encode(prompt).ids) + 256
                              ).bit_length())
        eng = Engine.build(NANO, "mtp", device="cpu", context=ctx, block=W)
        why = eng.compile_target(build=True)
        if why:
            raise SystemExit(f"the shipped wide step is not compiled here: {why}")
        ids = eng.encode(prompt)
        eng.generate(ids, max_new_tokens=1, draft=False, width=1)      # the prompt's K/V in the cache
        start = len(ids) - W
        win = torch.tensor(ids[start:start + W])
        pos = torch.arange(start, start + W)
        shipped = eng.static_step(W)
        eng.kv.length = start
        ref = shipped(win[None], eng.kv).logits[0].clone()

        def run_shipped(step=shipped, eng=eng, win=win, start=start):
            eng.kv.length = start
            step(win[None], eng.kv)
        arms = {"shipped wide step": (run_shipped, 0.0, True)}
        for name, (edits, names) in VARIANTS.items():
            mod = variant_module(edits, name)
            runner, inputs = compile_variant(mod, eng.model, eng.kv, W, name.startswith("experts per row"), names,
                                             home)
            flat = inputs.args(win, pos, start, W)
            got = runner(*flat)[0]
            arms[name] = (lambda runner=runner, flat=flat: runner(*flat),
                          float((got - ref).abs().max()), bool(torch.equal(got.argmax(-1), ref.argmax(-1))))
        times: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(a.rounds):
            for name, (fn, _, _) in arms.items():
                t0 = time.process_time()
                for _ in range(a.calls):
                    fn()
                times[name].append((time.process_time() - t0) / a.calls * 1e3)
        base = median(times["shipped wide step"])
        res = {}
        for name, (_, diff, top1) in arms.items():
            ms = median(times[name])
            res[name] = {"ms": ms, "vs_shipped": ms / base, "max_logit_diff": diff, "top1_equal": top1}
            rows.append([task, len(ids), name, f"{ms:.3f}", f"{ms / base:.2f}", f"{diff:.1e}", str(top1)])
        out["tasks"][task] = {"context_tokens": len(ids), "width": W, "arms": res}
    print_table(f"Compiled wide CPU step, {W} rows, {torch.get_num_threads()} thread(s), process time",
                ["task", "tokens", "arm", "ms/step", "x shipped", "max |dlogit|", "top-1 same"], rows)
    print(write_json("cpu_wide_variants.json", out))


if __name__ == "__main__":
    main()
