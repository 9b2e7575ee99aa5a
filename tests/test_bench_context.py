"""bench/context.py --smoke: every code path of the long-context benchmark on the CPU (a tiny A3B-like model, the
Triton interpreter), so the GPU runs that produce the issue's figures do not first fail on plumbing: decode rows at
one and two rows over both caches, prefill, transformers, the q8_0 agreement and the split kernel alone (one row over
a BF16 cache: the one-row chunk layout's partials)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_context_bench_smoke_runs_every_path_without_a_failed_kernel():
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "context.py"), "--smoke"], capture_output=True,
                       text=True, env={**env, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "split attention kernel alone" in out and "FAIL" not in out
    attn = [ln for ln in out.splitlines() if ln.startswith("│ 600 ")]
    assert len(attn) == 2 and all(" - " not in ln for ln in attn), attn      # BF16 and q8_0, both timed
    assert "decode bf16  ctx    300 W=1" in out and "decode q8_0  ctx    300 W=2" in out
