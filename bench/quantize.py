"""Quantizer throughput: runtime.quant.quantize vs gguf.quants.quantize on the same tensors, in one run.

MB/s counts BF16 input bytes (2 per value). Two rows per quant:
- `f32`: both get the same float32 array (the BF16 weights widened): `gguf.quants.quantize` vs `runtime.formats.blocks.quantize`;
- `bf16`: the converter's whole job from BF16 bits: gguf-py must widen to float32 first, ours widens per chunk
  (`runtime.formats.blocks.quantize_bf16`).
Each repeat times gguf-py and ours back to back (a noisy neighbour on a shared machine hurts both alike); the table
reports the median of the repeats. `CPU-time ratio` compares process CPU seconds (all our threads summed): the work
each side does, which a busy shared machine disturbs much less than wall time. Byte equality is checked every repeat.

    python bench/quantize.py [--rows 4096 --cols 4096 --repeats 5 --out bench/results/quantize.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from runtime.formats.blocks import bf16_bits_to_f32, f32_to_bf16_bits, quantize, quantize_bf16  # noqa: E402

QTYPES = ("q8_0", "q5_0", "q4_0")


def _timed(fn, *args) -> tuple[float, float, np.ndarray]:
    """(wall seconds, CPU seconds of the process, result)."""
    t0, c0 = time.perf_counter(), time.process_time()
    res = fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0, res


def _gguf_from_bits(bits: np.ndarray, gt: GGMLQuantizationType) -> np.ndarray:
    return gguf_quantize(bf16_bits_to_f32(bits), gt)


def run(rows: int, cols: int, repeats: int, seed: int = 0) -> dict:
    """Measure both quantizers; returns the JSON document."""
    rng = np.random.default_rng(seed)
    # BF16-representable weights with a realistic spread (some rows larger than others)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
    w *= rng.uniform(0.5, 2.0, size=(rows, 1)).astype(np.float32)
    bits = f32_to_bf16_bits(w)
    x = bf16_bits_to_f32(bits)
    mb = x.size * 2 / 1e6
    results = []
    for q in QTYPES:
        gt = GGMLQuantizationType[q.upper()]
        for mode in ("f32", "bf16"):
            g_times, o_times, g_cpu, o_cpu, equal = [], [], [], [], True
            for _ in range(repeats):
                if mode == "f32":
                    tg, cg, a = _timed(gguf_quantize, x, gt)
                    to, co, b = _timed(quantize, x, q)
                else:
                    tg, cg, a = _timed(_gguf_from_bits, bits, gt)
                    to, co, b = _timed(quantize_bf16, bits, q)
                g_times.append(tg)
                o_times.append(to)
                g_cpu.append(cg)
                o_cpu.append(co)
                equal = equal and bool(np.array_equal(a, b))
            g, o = statistics.median(g_times), statistics.median(o_times)
            results.append({"quant": q, "input": mode, "gguf_s": g, "ours_s": o, "gguf_mb_s": mb / g,
                            "ours_mb_s": mb / o, "ratio": g / o, "byte_identical": equal,
                            "cpu_ratio": statistics.median(g_cpu) / max(statistics.median(o_cpu), 1e-9)})
    return {"rows": rows, "cols": cols, "repeats": repeats, "input_mb_bf16": mb, "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "numpy": np.__version__, "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "quantize.json")
    args = ap.parse_args(argv)
    if args.cols % 32:
        ap.error("--cols must be a multiple of 32")
    load = os.getloadavg()
    doc = run(args.rows, args.cols, args.repeats)
    doc["load_average"] = load
    table = Table(title=f"quantize {args.rows}x{args.cols} ({doc['input_mb_bf16']:.1f} MB BF16), "
                        f"median of {args.repeats}, {doc['cpus']} CPUs, load {doc['load_average'][0]:.1f}")
    for col in ("quant", "input", "gguf-py MB/s", "ours MB/s", "ratio", "CPU-time ratio", "byte-identical"):
        table.add_column(col, justify="right")
    for r in doc["results"]:
        table.add_row(r["quant"], r["input"], f"{r['gguf_mb_s']:.0f}", f"{r['ours_mb_s']:.0f}", f"{r['ratio']:.2f}x", f"{r['cpu_ratio']:.2f}x",
                      "yes" if r["byte_identical"] else "NO")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, args.out)
    return 0 if all(r["byte_identical"] for r in doc["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
