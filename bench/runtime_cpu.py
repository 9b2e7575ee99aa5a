"""CPU decode speed of the runtime on a small random Qwen3-MoE: target-only vs MTP (random head: the overhead
floor) vs MTP steered by an oracle (every proposal right: the ceiling), plus the expert cache with half the
experts CPU-served.

    python bench/runtime_cpu.py [--threads 1] [--tokens 96] [--block 4]

Random weights: the numbers measure the machinery (draft/verify cost per window), not a trained drafter.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.drafters.base import Proposal
from runtime.drafters.mtp import MTPDrafter  # noqa: E402
from runtime.experts import ExpertCache  # noqa: E402
from runtime.kv import KVCache  # noqa: E402
from runtime.loading import load_target  # noqa: E402
from runtime.speculative import generate_ids  # noqa: E402
from tests.runtime.tiny import make_tiny_target  # noqa: E402


class Steered(MTPDrafter):
    """Runs the real MTP drafting (same cost) but proposes the known target continuation."""

    def __init__(self, model, capacity, seq):
        super().__init__(model, capacity)
        self.seq = seq

    def propose(self, anchor, pos, n, **kw):
        super().propose(anchor, pos, n, **kw)
        toks = self.seq[pos + 1: pos + 1 + n]
        return Proposal(torch.tensor(toks, dtype=torch.long), None, torch.ones(len(toks)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--block", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        folder = make_tiny_target(d, vocab=2048, hidden=256, layers=6, heads=8, kv_heads=2, head_dim=32,
                                  experts=16, top_k=4, moe_inter=256, inter=512, seed=0, scale=2.0)
        model = load_target(folder)
    c = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    prompt = list(range(10, 42))

    def kv():
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 512)

    def run(name, drafter=None, block=1, min_p=0.0):
        generate_ids(model, kv(), prompt, drafter=drafter, block=block, max_new_tokens=8)   # warm-up
        r = generate_ids(model, kv(), prompt, drafter=drafter, block=block, spec_min_p=min_p,
                         max_new_tokens=a.tokens)
        s = r.stats
        print(f"{name:34s} {s['decode_tok_s']:8.1f} tok/s  windows {s['windows']:3d}  "
              f"accepted {s['accepted']:3d}/{s['proposed']:3d}  draft {s['draft_s']:.3f}s verify {s['verify_s']:.3f}s")
        return r

    print(f"model: {n_params / 1e6:.1f} M params, {c.num_hidden_layers} layers, {c.num_experts} experts "
          f"(top-{c.num_experts_per_tok}), vocab {c.vocab_size}; threads {a.threads}; {a.tokens} new tokens")
    ref = run("target only")
    run(f"MTP random head, block {a.block}", MTPDrafter(model, 512), a.block)
    run(f"MTP random head, block {a.block}, min_p 0.5", MTPDrafter(model, 512), a.block, 0.5)
    seq = prompt + ref.token_ids
    for b in (a.block, 8):
        run(f"MTP oracle-steered, block {b}", Steered(model, 512, seq), b)
    cache = ExpertCache(model, torch.device("cpu"), slots=c.num_hidden_layers * c.num_experts // 2,
                        enforce_on_cpu=True)
    r = run("target only, half experts CPU-served")
    st = cache.stats()
    print(f"expert cache: {st['slots']}/{st['experts']} slots, hits {st['hits']}, misses {st['misses']}, "
          f"hit rate {st['hit_rate']:.2f}; output identical: {r.token_ids == ref.token_ids}")


if __name__ == "__main__":
    main()
