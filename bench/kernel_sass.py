"""The machine code of the one-row decode step's Triton kernels, from any machine: instructions in each kernel's
hot loop, per weight value, and what in them is not arithmetic (shared-memory round trips, barriers, shuffles).

    python bench/kernel_sass.py [--formats bf16,q4_0,q8_0] [--kv bf16|q8_0] [--width N] [--small] [--arch 90]
        [--dump DIR]

Why: Triton picks each tile's thread layout itself, and the GEMV kernels are fast only where that layout keeps a
program's weight rows in one thread (runtime/gpu/moe_gemv.py, module docstring). Which layout a Triton version
picks is visible in the SASS, and the SASS can be made without a GPU: Triton compiles for a named target with its
own ptxas. So this (1) runs the A3B-shaped target (one layer, a 4,096-token vocabulary; `bench/quant_target.py`'s
random weights) through the engine's one-row fused step in the Triton interpreter on the CPU, recording every
kernel launch (function, argument types, alignment, constexprs, warps), in a child process; (2) compiles each
recorded kernel for sm_`--arch` with this machine's Triton, as the launch would on that GPU (PDL on, the split
attention's L2 prefetch on sm_90+, a recorded register cap), and disassembles it (`cuobjdump`, shipped with
Triton); (3) reports per kernel: registers, instructions, and for its loops (backward branches): instructions per
pass, the weight values a thread takes per pass where the kernel is a GEMV (`_gemv_kernel`: from its tile
constexprs) and so instructions per value, and the BAR / STS / LDS / SHFL in the loop; a kernel the compiler
refuses is listed with its error (the interpreter checks no types, so this is where a GPU-only failure shows
without a GPU). Run it under each Triton a user may have (the device's and the CI's differ) and compare; `--kv
q8_0` records the step over a q8_0 cache, `--width 8` a verify window's step, `--small` a narrow model (seconds).

Writes `kernel_sass_<formats>[_kvq8_0][_wN]_triton<version>.json` (and each kernel's SASS under `--dump`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
SMALL_VOCAB = 4096
# `--small`: the A3B's head size, head ratio and rows of 256-value multiples, at a fraction of its widths, so the
# interpreter records the same kernels in seconds (a compile check without a GPU; the tiles of shape-picked
# variants may differ from the A3B's)
SMALL_SHAPE = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_experts": 16,
               "num_experts_per_tok": 4, "moe_intermediate_size": 256, "intermediate_size": 1024, "vocab_size": 512}
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.int32": "i32",
           "torch.int64": "i64", "torch.int16": "i16", "torch.uint8": "u8", "torch.int8": "i8", "torch.bool": "i1"}


# ---------------------------------------------------------------------------------------------- 1. record (child)

def record(formats: list[str], out: Path, kv_kind: str = "bf16", small: bool = False, width: int = 1) -> None:
    """Interpreter child: one step of `width` rows per format, every kernel launch written to `out` as JSON
    lines."""
    import torch
    import triton.runtime.interpreter as interp

    import tests.runtime.kernels_check  # noqa: F401  (the interpreter's patches: loaded scalars as loop bounds)
    from bench.common import A3B_SHAPE
    from bench.quant_target import build_on_gpu
    from runtime.gpu.static_step import StaticStep
    from runtime.kv import KVCache

    fmt_now = [""]
    seen: set[str] = set()
    f = out.open("w")
    run = interp.InterpretedFunction.run

    def rec(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        names = list(inspect_args(fn))
        params = []
        for name, a in zip(names, args, strict=False):
            params.append([name, describe(a)])
        for k, v in kwargs.items():
            if k in names:
                params.append([k, describe(v)])
        opts = {k: v for k, v in kwargs.items() if k not in names}
        entry = {"format": fmt_now[0], "module": fn.__module__, "name": fn.__name__, "params": params,
                 "num_warps": int(opts.get("num_warps", 4)), "num_stages": int(opts.get("num_stages", 3))}
        if opts.get("maxnreg"):
            entry["maxnreg"] = int(opts["maxnreg"])
        if "enable_fp_fusion" in opts:
            entry["enable_fp_fusion"] = bool(opts["enable_fp_fusion"])
        key = json.dumps([entry["module"], entry["name"], params, entry["num_warps"]], default=str)
        if key not in seen:
            seen.add(key)
            f.write(json.dumps(entry, default=str) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = rec
    cfg = {**A3B_SHAPE, "num_hidden_layers": 1, "vocab_size": SMALL_VOCAB, **(SMALL_SHAPE if small else {})}
    with torch.no_grad():
        for fmt in formats:
            fmt_now[0] = fmt
            model = build_on_gpu(cfg, fmt, device="cpu")
            c = model.cfg
            kv = KVCache(1, c.num_key_value_heads, c.head_dim, 128, dtype=torch.bfloat16,
                         quant="q8_0" if kv_kind == "q8_0" else None)
            if kv.k.is_floating_point():
                kv.k.normal_()
                kv.v.normal_()
            else:                                   # q8_0 codes and their scales
                kv.k.random_(-127, 128)
                kv.v.random_(-127, 128)
                kv.k_scale.fill_(0.01)
                kv.v_scale.fill_(0.01)
            kv.length = 64
            step = StaticStep(model, kv, width, graph=False)
            if not step.fused:
                raise SystemExit(f"the {width}-row step of {fmt} is not the fused one on this machine")
            step(torch.arange(11, 11 + width)[None], kv)
    f.close()


def inspect_args(fn) -> list[str]:
    import inspect

    return list(inspect.signature(fn).parameters)


def describe(a: Any) -> Any:
    """A launch argument as the compiler sees it: a tensor's dtype and 16-byte alignment, an int's value."""
    import torch

    if isinstance(a, torch.Tensor):
        return {"tensor": _DTYPES.get(str(a.dtype), str(a.dtype)), "aligned": a.data_ptr() % 16 == 0}
    if isinstance(a, bool):
        return {"bool": a}
    if isinstance(a, int):
        return {"int": a}
    if isinstance(a, float):
        return {"float": a}
    return {"other": str(a)}


# ---------------------------------------------------------------------------------------------- 2. compile

def compile_entry(e: dict[str, Any], arch: int):
    """The recorded launch compiled for sm_`arch`: (CompiledKernel, constexprs)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.gpu.kernels import FMA

    jf = getattr(importlib.import_module(e["module"]), e["name"])
    names = list(jf.arg_names)
    given = dict((n, d) for n, d in e["params"])
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    no_spec = set(getattr(jf, "do_not_specialize", []) or [])
    no_spec |= {names[i] for i in no_spec if isinstance(i, int)}
    for i, n in enumerate(names):
        p = jf.params[i]
        d = given.get(n)
        if p.is_constexpr:
            v = p.default if d is None else next(iter(d.values()))
            if n == "GDC":
                v = True                            # a Hopper launch runs with PDL (runtime/gpu/pdl.py)
            sig[n] = "constexpr"
            consts[(i,)] = v
        elif d is None and p.has_default and p.default is None:
            sig[n] = "constexpr"                    # an optional tensor left out: Triton takes None as a constant
            consts[(i,)] = None
        elif d is None:
            raise ValueError(f"{e['name']}: no value recorded for {n}")
        elif "tensor" in d:
            sig[n] = "*" + d["tensor"]
            if d["aligned"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif "bool" in d:
            sig[n] = "i1"
        elif "int" in d:
            v = d["int"]
            if v == 1 and n not in no_spec:
                sig[n] = "constexpr"
                consts[(i,)] = 1
            else:
                sig[n] = "i64" if abs(v) >= 2 ** 31 else "i32"
                if v % 16 == 0 and n not in no_spec:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif "float" in d:
            sig[n] = "fp32"
        else:
            raise ValueError(f"{e['name']}: cannot type argument {n}: {d}")
    src = ASTSource(jf, sig, consts, attrs)
    opts = {"num_warps": e["num_warps"], "num_stages": e["num_stages"]}
    if e.get("maxnreg"):
        opts["maxnreg"] = e["maxnreg"]
    # the runtime names Triton's FMA contraction on every launch (runtime/gpu/kernels.py FMA): an entry written by
    # hand gets the runtime's
    opts["enable_fp_fusion"] = e.get("enable_fp_fusion", FMA["enable_fp_fusion"])
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    return k, {names[i[0]]: v for i, v in consts.items()}


def _split_prefetch() -> int:
    """The split attention's L2 prefetch on a GPU of compute capability 9.0+ (the interpreter records 0)."""
    from runtime.gpu import attention_kernels as ak

    return int(ak.SPLIT_KV_PREFETCH) if ak.SPLIT_KV_PREFETCH and ak.SPLIT_EXIT_EARLY else 0


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_and_regs(k) -> tuple[str, int | None]:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(k.asm["cubin"])
        sass = subprocess.run([tool("cuobjdump"), "-sass", str(p)], capture_output=True, text=True).stdout
        res = subprocess.run([tool("cuobjdump"), "-res-usage", str(p)], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", res)
    return sass, (int(m.group(1)) if m else None)


# ---------------------------------------------------------------------------------------------- 3. count

_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")
NOT_ARITH = ("BAR", "STS", "LDS", "SHFL", "STSM", "LDSM")


def instructions(sass: str) -> list[tuple[int, str]]:
    out = []
    for ln in sass.splitlines():
        m = _INS.match(ln)
        if m:
            tok = m.group(2).split()
            op = tok[1] if tok and tok[0].startswith("@") and len(tok) > 1 else (tok[0] if tok else "")
            out.append((int(m.group(1), 16), op.split(".")[0]))
    return out


def loops(sass: str) -> list[dict[str, Any]]:
    """Each backward branch's span: its instruction count and opcode counts, innermost (shortest) first."""
    ins = instructions(sass)
    raw = sass.splitlines()
    spans = []
    for ln in raw:
        m = _INS.match(ln)
        if m and "BRA" in m.group(2):
            b = _BRA.search(m.group(2))
            if b and int(b.group(1), 16) < int(m.group(1), 16):
                spans.append((int(b.group(1), 16), int(m.group(1), 16)))
    out = []
    for a, b in sorted(set(spans), key=lambda s: s[1] - s[0]):
        c = collections.Counter(op for ad, op in ins if a <= ad <= b)
        out.append({"start": hex(a), "end": hex(b), "instructions": sum(c.values()),
                    "not_arithmetic": {k: c[k] for k in NOT_ARITH if c[k]}, "ops": dict(c.most_common(12))})
    return out


def gemv_values_per_pass(consts: dict[str, Any], num_warps: int) -> int | None:
    """Weight values a thread multiplies in one pass of `_gemv_kernel`'s looped tiles (None: a one-step tile)."""
    if consts.get("ONE"):
        return None
    qt, bn, nbc = consts.get("QT"), consts.get("BN"), consts.get("NBC")
    if qt is None or bn is None or nbc is None:
        return None
    from runtime.gpu import moe_gemv

    vals = moe_gemv.BLOCK_VALUES[qt] * nbc * bn * (2 if consts.get("UP") else 1) * consts.get("MB", 1)
    return max(1, vals // (32 * num_warps))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="bf16,q4_0,q8_0")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--kv", default="bf16", choices=("bf16", "q8_0"), help="the KV cache the step reads")
    ap.add_argument("--small", action="store_true", help="a narrow model of the A3B's head shape (SMALL_SHAPE)")
    ap.add_argument("--width", type=int, default=1, help="the step's rows (1: decoding alone; 8: a verify window)")
    ap.add_argument("--dump", default="")
    ap.add_argument("--launches", default="", help="a launches file to read (or, when it does not exist, to write): "
                    "record once, compile under several Tritons")
    ap.add_argument("--record", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.record:
        record(args.formats.split(","), Path(args.record), args.kv, args.small, args.width)
        return {}
    import triton

    from bench.common import machine, print_table, write_json

    with tempfile.TemporaryDirectory() as d:
        log = Path(args.launches) if args.launches else Path(d) / "launches.jsonl"
        if not log.exists():
            env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
            p = subprocess.run([sys.executable, __file__, "--formats", args.formats, "--kv", args.kv, "--record",
                                str(log), "--width", str(args.width)] + (["--small"] if args.small else []), env=env,
                               capture_output=True, text=True, cwd=ROOT)
            if p.returncode != 0:
                raise SystemExit("recording the step's launches failed:\n" + p.stderr[-3000:])
        entries = [json.loads(ln) for ln in log.read_text().splitlines() if ln]
    if args.arch >= 90:                             # the split attention's prefetch, as `_kv_prefetch` sets it there
        for e in entries:
            if e["name"] == "_attn_split_kernel":
                e["params"] = [[n, {"int": _split_prefetch()} if n == "PF" else d] for n, d in e["params"]]
    rows, res = [], {"machine": machine(), "triton": triton.__version__, "arch": args.arch, "kernels": []}
    for e in entries:
        try:
            k, consts = compile_entry(e, args.arch)
        except Exception as ex:  # one kernel the compiler refuses must not hide the others
            lines = str(ex).strip().splitlines() or [""]    # a compile error: its place first, its cause last
            res["kernels"].append({"format": e["format"], "kernel": e["name"],
                                   "error": f"{type(ex).__name__}: {lines[0][:100]} {lines[-1][:300]}"})
            continue
        sass, regs = sass_and_regs(k)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            Path(args.dump, f"{e['format']}_{e['name']}_{k.hash[:8]}.sass").write_text(sass)
        lp = loops(sass)
        vpp = gemv_values_per_pass(consts, e["num_warps"]) if e["name"] == "_gemv_kernel" else None
        inner = lp[0] if lp else None
        tile = {n: consts.get(n) for n in ("QT", "UP", "BN", "NBC", "J", "ONE", "MB", "PF", "NORM") if n in consts}
        rec = {"format": e["format"], "kernel": e["name"], "num_warps": e["num_warps"], "registers": regs,
               "instructions": len(instructions(sass)), "tile": tile, "loops": lp, "values_per_pass": vpp,
               "instr_per_value": (inner["instructions"] / vpp) if (inner and vpp) else None,
               "enable_fp_fusion": e.get("enable_fp_fusion")}
        res["kernels"].append(rec)
        rows.append([e["format"], e["name"], json.dumps(tile, separators=(",", ":"))[:48], e["num_warps"], regs,
                     rec["instructions"], inner["instructions"] if inner else "-", vpp or "-",
                     rec["instr_per_value"] or "-",
                     " ".join(f"{a}:{b}" for a, b in inner["not_arithmetic"].items()) if inner else "-"])
    print_table(f"SASS of the {args.width}-row step's kernels (Triton {triton.__version__}, sm_{args.arch})",
                ["format", "kernel", "tile", "warps", "regs", "instr", "loop instr", "values / pass",
                 "instr / value", "in the loop: smem, barriers, shuffles"], rows)
    for r in res["kernels"]:
        if "error" in r:
            print(f"{r['format']} {r['kernel']}: {r['error']}")
    kv = ("" if args.kv == "bf16" else f"_kv{args.kv}") + ("" if args.width == 1 else f"_w{args.width}")
    write_json(f"kernel_sass_{args.formats.replace(',', '_')}{kv}_triton{triton.__version__}.json", res)
    return res


if __name__ == "__main__":
    main()
