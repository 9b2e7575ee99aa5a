"""Speculation where the target costs what a real one costs: acceptance from the trained bundled target, cost from
a Qwen3-30B-A3B-shaped model run beside it.

    python bench/spec_scale.py [--full] [--check] [--device cuda] [--new-tokens 128] [--max-seconds 230]
                               [--extra-head PATH[:LABEL]]

What the target is, exactly (also in bench/README.md):
- The pack's trained target (setup_wizard/bundled/strata-nano, BF16) decides every token: its logits, hidden states
  and taps are what the drafters see and what acceptance compares against, so tokens per window are real.
- Beside it runs "the tower": a model of the Qwen3-30B-A3B shape with random BF16 weights (48 layers, hidden 2048,
  32 query / 4 KV heads of 128, 128 experts top-8 of width 768, vocab 151936; bench/common.py's builder) with honest
  routing: embeddings at std 1, each layer's attention o_proj and experts' down_proj at 0.05 x 0.02, so a token's
  router input stays its own and a window of W tokens touches about as many experts as independent top-8 choices
  (a std-0.02 random model sends nearly every token to the same experts and flatters wide windows). The tower reads
  the same token ids at the same positions, with its own KV cache (filled with each task's prompt once, by a plain
  forward), through its own fixed-width CUDA-graph step, final norm and 151936-row lm_head included.
- Every decode/verify window runs both steps at the same width; the tower's logits (first 4096 columns) are
  multiplied by 0 and added to the pack's: x + 0 * y = x for finite y, so the output is the pack's bit for bit
  (`--check` verifies it), while the bytes read, the kernels launched and the routing fan-out of each window are an
  A3B's. The prompt's prefill runs the pack only (prefill is not timed here).
- Drafters are the pack's own (its MTP head, its DFlash2 heads), so their cost is a small drafter's, not an A3B
  drafter's: each arm reports draft ms per window (its time in the windows; its share of the prompt, once a
  prompt, is `prompt_observe_ms`) next to the drafter's bytes per window / copy bandwidth and as a share of the
  A3B step.

Rows: target alone; MTP chains 2-4 (blocks 3-5); DFlash2 BF16 blocks 4/6/8 (default head) and 12/16 (turbo head);
DFlash2 Q8_0/Q4_0 (converted on the fly, needs `gguf`) at the BF16 head's best block (`--full`: every block); on the
code, math, prose and long (3,047-token) prompts, greedy, then sampled (temperature 0.7, top-p 0.9) for the target
and the best MTP and DFlash2 arms (`--full`: every arm), and MTP chains 3 and 4 drawing their drafts at 1.5x the
temperature; `--sampled-seeds N` takes each sampled row over N seeds (medians), `--sampled-temperature`,
`--sampled-top-p` its setting. Also the A3B step at widths 1-16 with the distinct experts
per layer a window of that width touches. Writes spec_scale.json ($OUT on the device, else bench/results/).

`--check`: greedy, a few tokens, every arm and task: speculative == target-only at the same step width (exit 1
otherwise), and target-only through the tower step == the pack's own step (the tower changes no logit).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    A3B_SHAPE,
    NANO,
    NANO_DFLASH2,
    ROOT,
    Deadline,
    build_random_a3b,
    copy_bandwidth,
    distinct_experts,
    machine,
    median,
    print_table,
    task_prompts,
    write_json,
)
from runtime import speculative  # noqa: E402
from runtime.gpu import capture  # noqa: E402
from runtime.gpu.static_step import StaticStep  # noqa: E402
from runtime.kv import KVCache  # noqa: E402
from runtime.models.layers import SparseMoe  # noqa: E402
from runtime.models.qwen3_moe import TargetOutput  # noqa: E402
from runtime.sampling import SamplingParams, probs  # noqa: E402
from runtime.speculative import generate_ids  # noqa: E402

NANO_TURBO = ROOT / "setup_wizard" / "bundled" / "strata-nano-dflash2-turbo"
# a toy tower for `--shape tiny` (CPU smoke runs of this script; no figure from it means anything)
TINY = {**A3B_SHAPE, "vocab_size": 8192, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 32, "intermediate_size": 128}
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, seed=1234)


# ------------------------------------------------------------------------------------------------ the target
def build_tower(shape: dict, device: str, seed: int = 0):
    """The A3B-shaped tower with honest routing (module docstring; bench/common.py builds it, experts stacked)."""
    model, _ = build_random_a3b(shape, device=device, seed=seed, honest=True)
    return model


class ScaledTarget:
    """What the speculative loop calls for the prompt: the pack's target. The tower's K/V for the prompt come from
    `Harness.fill_tower` (once per task); decode windows go through `ScaledStep`."""

    def __init__(self, nano, tower_kv: KVCache) -> None:
        self.nano, self.tower_kv = nano, tower_kv
        self.cfg, self.model, self.lm_head, self.mtp, self.rotary = nano.cfg, nano.model, nano.lm_head, nano.mtp, \
            nano.rotary
        self.filled = 0          # prompt positions whose tower K/V are in tower_kv

    def __call__(self, input_ids, positions=None, kv=None, taps=(), logits_to_keep: int = 0) -> TargetOutput:
        if logits_to_keep == 0:
            raise RuntimeError("a decode window reached the plain forward; every window must run the scaled step.")
        out = self.nano(input_ids, kv=kv, taps=taps, logits_to_keep=logits_to_keep)
        if kv.length > self.filled:
            raise RuntimeError("the tower holds no K/V for this prompt; fill it first (Harness.fill_tower).")
        self.tower_kv.length = kv.length
        return out


class ScaledStep:
    """One decode/verify window: the pack's fixed-width step, then the tower's at the same width on the same ids and
    positions; logits = pack + 0 * tower[:, :V] (the same bits as the pack's alone)."""

    def __init__(self, nano_step: StaticStep, tower_step: StaticStep, tower_kv: KVCache) -> None:
        self.nano, self.tower, self.tower_kv = nano_step, tower_step, tower_kv
        self.width = nano_step.width

    def accepts(self, n: int, taps: tuple[int, ...]) -> bool:
        return self.nano.accepts(n, taps)

    def __call__(self, window, kv: KVCache, taps: tuple[int, ...] = ()) -> TargetOutput:
        start = kv.length
        o = self.nano(window, kv, taps)
        self.tower_kv.length = start
        t = self.tower(window, self.tower_kv, ())
        V = o.logits.shape[-1]
        return TargetOutput(logits=o.logits + 0.0 * t.logits[..., :V].float(), hidden=o.hidden, taps=o.taps)

    def info(self) -> dict[str, Any]:
        return {"width": self.width, "graph": self.nano.use_graph and self.tower.use_graph,
                "fused": [self.nano.fused, self.tower.fused], "errors": self.nano.errors + self.tower.errors}


class Harness:
    def __init__(self, args) -> None:
        from runtime.engine import Engine

        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.ctx = args.context
        eng = Engine.build(NANO, "mtp", device=args.device, context=args.context)     # the pack + its MTP head
        self.nano, self.kv, self.tok = eng.model, eng.kv, eng.tokenizer
        self.dtype = self.nano.lm_head.weight.dtype
        self.drafters: dict[str, Any] = {"mtp": eng.drafter}
        t0 = time.perf_counter()
        self.tower = build_tower(TINY if args.shape == "tiny" else A3B_SHAPE, args.device)
        c = self.tower.cfg
        self.tower_kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, args.context,
                                dtype=self.tower.lm_head.weight.dtype, device=self.dev)
        self.sync()
        self.tower_build_s = time.perf_counter() - t0
        self.target = ScaledTarget(self.nano, self.tower_kv)
        self.nano_steps: dict[int, StaticStep] = {}
        self.tower_steps: dict[int, StaticStep] = {}
        self.steps: dict[int, ScaledStep] = {}
        self.filled_task: str | None = None
        if self.cuda:
            self.attach_graphs(eng.drafter)
            # the MTP head's graphs through its modules (before its layer ran on the fused kernels), for an A/B
            from runtime.drafters import mtp

            mtp.FUSED = False
            self.drafters["mtp-module"] = mtp.MTPDrafter(self.nano, eng.drafter.kv.capacity,
                                                         max_block=eng.drafter.max_block)
            self.attach_graphs(self.drafters["mtp-module"])
            mtp.FUSED = True

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def attach_graphs(self, d) -> None:
        if self.cuda and getattr(d, "graphs", False) is None:
            d.graphs = d.make_graphs()

    def add_dflash2(self, key: str, path: Path) -> None:
        from runtime.drafters.dflash2.loading import load_dflash2_drafter

        d = load_dflash2_drafter(path, self.nano, device=self.dev, dtype=self.dtype, context=self.ctx)
        self.attach_graphs(d)
        self.drafters[key] = d

    def tower_step(self, w: int) -> StaticStep:
        if w not in self.tower_steps:
            self.tower_steps[w] = StaticStep(self.tower, self.tower_kv, w, graph=self.cuda)
        return self.tower_steps[w]

    def nano_step(self, w: int) -> StaticStep:
        if w not in self.nano_steps:
            self.nano_steps[w] = StaticStep(self.nano, self.kv, w, graph=self.cuda)
        return self.nano_steps[w]

    def step(self, w: int) -> ScaledStep:
        if w not in self.steps:
            self.steps[w] = ScaledStep(self.nano_step(w), self.tower_step(w), self.tower_kv)
        return self.steps[w]

    @torch.no_grad()
    def fill_tower(self, task: str, ids: list[int], chunk: int = 512) -> None:
        """The tower's K/V for a task's prompt (a plain chunked forward, no logits), once per task."""
        if self.filled_task == task:
            return
        self.tower_kv.reset()
        for s in range(0, len(ids), chunk):
            part = torch.tensor([ids[s:s + chunk]], dtype=torch.long, device=self.dev)
            self.tower(part, kv=self.tower_kv, logits_to_keep=-1)
        self.sync()
        self.target.filled = len(ids)
        self.filled_task = task

    def generate(self, ids: list[int], kind: str | None, block: int, width: int, n_new: int,
                 sampling: SamplingParams | None = None, min_p: float = 0.0, scaled: bool = True,
                 ahead: bool = True, rule_graphs: bool = True, draft_temp_scale: float = 1.0) -> Any:
        """`ahead` False: the drafter observes and drafts after each window's read, as before drafting ahead, and a
        target-only step is queued after the read, as before decoding ahead. A
        `-dq` drafter's graphs are captured with its stacked block products dequantized + matmul (the path before
        the GEMV launch, runtime/gpu/capture.py DRAFT_QUANT_PATH); a `-qone...` drafter's with them on that one-step
        block tile, a `-looped` one's on the decode windows' tiles (capture.DRAFT_GEMV). `rule_graphs` False: a
        sampled window's acceptance as eager ops (runtime/speculative.py SAMPLED_GRAPHS, the runtime before)."""
        d = self.drafters[kind] if kind else None
        step = self.step(width) if scaled else self.nano_step(width)
        model = self.target if scaled else self.nano
        speculative.DRAFT_AHEAD = speculative.DECODE_AHEAD = ahead
        speculative.SAMPLED_GRAPHS = rule_graphs
        capture.DRAFT_QUANT_PATH = "dequant" if kind and kind.endswith("-dq") else "gemv"
        tiles = kind.rpartition("-")[2] if kind else ""
        shipped = dict(capture.DRAFT_GEMV)
        if tiles == "looped":          # the decode windows' variants (moe_gemv.DECODE_GEMV): the runtime before
            capture.DRAFT_GEMV.clear()
        elif tiles in DRAFT_TILES:
            capture.DRAFT_GEMV.update(dict.fromkeys(("q8_0", "q4_0"), tiles))
        try:
            return generate_ids(model, self.kv, ids, drafter=d, max_new_tokens=n_new, sampling=sampling,
                                block=block if d else 1, spec_min_p=min_p, stop_ids=set(), step=step,
                                draft_temp_scale=draft_temp_scale)
        finally:
            speculative.DRAFT_AHEAD = speculative.DECODE_AHEAD = True
            speculative.SAMPLED_GRAPHS = True
            capture.DRAFT_QUANT_PATH = "gemv"
            capture.DRAFT_GEMV.clear()
            capture.DRAFT_GEMV.update(shipped)


# ------------------------------------------------------------------------------------------------ the A3B step
@torch.no_grad()
def verify_cost(h: Harness, ids: list[int], widths: list[int], reps: int) -> dict[str, Any]:
    """The tower's fixed-width step at each width (median of `reps` replays at the prompt's context), and the
    distinct experts per layer a window of that width touches (one plain forward over the prompt, routers read)."""
    h.fill_tower("code", ids)
    L = len(ids)
    window_ids = torch.tensor([ids[:max(widths)]], dtype=torch.long, device=h.dev)
    ms: dict[int, float] = {}
    for w in widths:
        st = h.tower_step(w)
        win = window_ids[:, :w]
        times = []
        for r in range(reps + 2):
            h.tower_kv.length = L
            if h.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                st(win, h.tower_kv)
                b.record()
                b.synchronize()
                dt = a.elapsed_time(b)
            else:
                t = time.perf_counter()
                st(win, h.tower_kv)
                dt = 1e3 * (time.perf_counter() - t)
            if r >= 2:                                   # the first two: capture and warm-up
                times.append(dt)
        ms[w] = median(times)
    h.tower_kv.length = L
    experts = {}
    for w in widths:
        d = distinct_experts(h.tower, ids[:256], w)
        experts[w] = {"mean": d["mean"], "uniform": d["uniform"]}
    return {"context": L, "step_ms": ms, "relative": {w: ms[w] / ms[widths[0]] for w in widths},
            "distinct_experts_per_layer": experts, "routing": "honest (embeddings std 1, residual writes x 0.05)"}


# ------------------------------------------------------------------------------------------------ the arms
# other tiles for a quantized head's stacked products (shipped: runtime/gpu/capture.py DRAFT_GEMV): one-step block
# tiles (runtime/gpu/moe_gemv.py "qone{rows}j{words}") and "looped", the decode windows' (the runtime before)
DRAFT_TILES = ("looped", "qone8j1", "qone16j2", "qone4j1")


def arm_list(h: Harness, gguf_dir: Path | None) -> list[dict[str, Any]]:
    arms = [{"arm": "target-only", "kind": None, "block": 1, "family": "target"}]
    for chain in (2, 3, 4):
        arms.append({"arm": f"MTP chain {chain} (b{chain + 1})", "kind": "mtp", "block": chain + 1, "family": "mtp"})
    if "mtp-module" in h.drafters:
        for chain in (3, 4):
            arms.append({"arm": f"MTP chain {chain} (b{chain + 1}), module graphs", "kind": "mtp-module",
                         "block": chain + 1, "family": "mtp-module"})
    for b in (4, 6, 8):
        arms.append({"arm": f"DFlash2 bf16 b{b}", "kind": "dflash2", "block": b, "family": "dflash2", "quant": "bf16"})
    # the same drafters observing and drafting after each window's read (before drafting ahead), and the target
    # alone with each step queued after the read (before decoding ahead): A/Bs in one run
    arms.append({"arm": "target-only, after the read", "kind": None, "block": 1, "family": "target-after",
                 "ahead": False})
    arms.append({"arm": "MTP chain 3 (b4), after the read", "kind": "mtp", "block": 4, "family": "mtp-after",
                 "ahead": False})
    arms.append({"arm": "DFlash2 bf16 b6, after the read", "kind": "dflash2", "block": 6, "family": "dflash2-after",
                 "quant": "bf16", "ahead": False})
    # sampled only: the acceptance rule as eager ops, one launch each (before its CUDA graphs), next to the same arm
    # with the graphs
    arms.append({"arm": "target-only, eager sampling rule", "kind": None, "block": 1, "family": "target-eager",
                 "eager_rule": True, "sampled_only": True})
    arms.append({"arm": "MTP chain 3 (b4), eager sampling rule", "kind": "mtp", "block": 4, "family": "mtp-eager",
                 "eager_rule": True, "sampled_only": True})
    # sampled only: the MTP chain drawing its drafts at 1.5x the temperature (what calibration picks for the pack's
    # head, docs/models.md "Draft temperature"), next to the same chain at 1x
    for chain in (3, 4):
        arms.append({"arm": f"MTP chain {chain} (b{chain + 1}), drafts x1.5", "kind": "mtp", "block": chain + 1,
                     "family": "mtp-hot", "draft_temp_scale": 1.5, "sampled_only": True})
    if "extra" in h.drafters:
        label = h.extra_label
        for b in (4, 6, 8):
            arms.append({"arm": f"DFlash2 {label} bf16 b{b}", "kind": "extra", "block": b, "family": "dflash2",
                         "quant": "bf16"})
    if "turbo" in h.drafters:
        for b in (12, 16):
            arms.append({"arm": f"DFlash2 turbo bf16 b{b}", "kind": "turbo", "block": b, "family": "dflash2",
                         "quant": "bf16"})
    if gguf_dir is not None:
        for q in ("q8_0", "q4_0"):
            for b in (4, 6, 8):
                arms.append({"arm": f"DFlash2 {q} b{b}", "kind": f"dflash2-{q}", "block": b, "family": "dflash2",
                             "quant": q, "quantized": True})
            for b in (4, 6, 8):        # the same head, its stacked products dequantized into scratch + matmul
                arms.append({"arm": f"DFlash2 {q} b{b}, dequantize + matmul", "kind": f"dflash2-{q}-dq",
                             "block": b, "family": "dflash2-dq", "quant": q, "quantized": True, "qpath": "dequant"})
            for v in DRAFT_TILES:      # the same head's stacked products on other tiles
                for b in (4, 6, 8):
                    arms.append({"arm": f"DFlash2 {q} b{b}, {v}", "kind": f"dflash2-{q}-{v}", "block": b,
                                 "family": "dflash2-one", "quant": q, "quantized": True, "qpath": v})
    return arms


def load_drafters(h: Harness, tmp: Path, extra: str = "") -> Path | None:
    h.add_dflash2("dflash2", NANO_DFLASH2)
    if extra:                                   # another head for this target, e.g. the one a re-training replaces
        path, _, label = extra.partition(":")
        h.add_dflash2("extra", Path(path))
        h.extra_label = label or "extra"
    if (NANO_TURBO / "model.safetensors").is_file():
        h.add_dflash2("turbo", NANO_TURBO)
    try:
        import gguf  # noqa: F401

        from setup_wizard.convert import convert_dflash2
    except ImportError as e:
        print(f"no Q8_0/Q4_0 rows: {e}", flush=True)
        return None
    for q in ("q8_0", "q4_0"):
        convert_dflash2(NANO_DFLASH2, q, tmp / f"{q}.gguf")
        h.add_dflash2(f"dflash2-{q}", tmp / f"{q}.gguf")
        h.add_dflash2(f"dflash2-{q}-dq", tmp / f"{q}.gguf")     # its graphs captured with the dequantizing path
        for v in DRAFT_TILES:                                        # ... with other tiles
            h.add_dflash2(f"dflash2-{q}-{v}", tmp / f"{q}.gguf")
    return tmp


def drafter_bytes(h: Harness, kind: str | None, block: int) -> int:
    """Weight bytes one window's drafting reads: MTP, per chained step its layer (top-k experts only), the shared
    lm_head and an embedding row; DFlash2, the head as stored plus the shared lm_head, once per block."""
    if kind is None:
        return 0
    nano = h.nano
    head = nano.lm_head.weight.numel() * nano.lm_head.weight.element_size()
    if kind in ("mtp", "mtp-module"):
        mtp = nano.mtp
        total = 0
        for name, p in mtp.named_parameters():
            if ".experts." in name:
                continue
            total += p.numel() * p.element_size()
        mlp = mtp.layers[0].mlp
        if isinstance(mlp, SparseMoe):
            per_exp = sum(p.numel() * p.element_size() for p in mlp.experts[0].parameters())
            total += mlp.top_k * per_exp
        return (block - 1) * (total + head + nano.cfg.hidden_size * nano.lm_head.weight.element_size())
    rep = h.drafters[kind].memory_report()
    return int(rep["drafter_weights"]) + head


def record(runs: list[Any]) -> dict[str, Any]:
    st = [r.stats for r in runs]
    w = [max(s["windows"], 1) for s in st]
    return {"tok_s": median([s["decode_tok_s"] for s in st]),
            "tokens_per_window": median([(s["generated_tokens"] - 1) / n for s, n in zip(st, w, strict=True)]),
            # the drafter's time a window; its share of the prompt (once a prompt) apart
            "draft_ms": median([1e3 * s["draft_window_s"] / n for s, n in zip(st, w, strict=True)]),
            "prompt_observe_ms": median([1e3 * s["observe_prompt_s"] for s in st]),
            "verify_ms": median([1e3 * s["verify_s"] / n for s, n in zip(st, w, strict=True)]),
            # a window's wall time: draft + verify + what neither span holds (the GPU waiting for the host)
            "window_ms": median([1e3 * s["decode_s"] / n for s, n in zip(st, w, strict=True)]),
            "drafted_ahead": median([s["drafted_ahead"] / n for s, n in zip(st, w, strict=True)]),
            "accept_rate": median([s["accepted"] / max(s["proposed"], 1) for s in st]),
            "windows": median([float(s["windows"]) for s in st])}


@torch.no_grad()
def mean_logprob(h: Harness, prompt: list[int], out: list[int], sp: SamplingParams) -> float:
    """Mean log-probability of the generated tokens under the target's sampling distribution (the pack alone, one
    plain forward): a sampler biased toward the drafter's tokens would move it."""
    ids = torch.tensor([prompt + out], dtype=torch.long, device=h.dev)
    logits = h.nano(ids).logits[0, len(prompt) - 1: -1]
    p = probs(logits, sp)
    tok = torch.tensor(out, device=h.dev)
    return float(torch.log(p.gather(-1, tok[:, None]).clamp_min(1e-30)).mean())


def run_arms(h: Harness, arms: list[dict], prompts: dict[str, list[int]], args, deadline: Deadline,
             res: dict[str, Any]) -> None:
    """Greedy: every arm on every task (task by task, so the tower is filled once per task); then sampled."""
    warmed: set[tuple] = set()
    refs: dict[tuple[str, int], list[int]] = {}

    def target_ref(task: str, ids: list[int], width: int) -> list[int]:
        if (task, width) not in refs:
            refs[(task, width)] = h.generate(ids, None, 1, width, args.new_tokens).token_ids
        return refs[(task, width)]

    def warm(kind, block, width, ids, sp=None, ahead=True, rule_graphs=True) -> None:
        key = (kind, block, width, sp is None, ahead, rule_graphs)
        if key not in warmed:                      # graph capture for this drafter and width, untimed
            h.generate(ids, kind, block, width, 8, sampling=sp, ahead=ahead, rule_graphs=rule_graphs)
            warmed.add(key)

    sampled = SamplingParams(temperature=args.sampled_temperature, top_p=args.sampled_top_p, seed=SAMPLED.seed)

    def seeded(sp: SamplingParams | None, i: int) -> SamplingParams | None:
        """Run i's sampling: with --sampled-seeds > 1 each run its own seed (its own trajectory)."""
        return sp if sp is None or args.sampled_seeds <= 1 else replace(sp, seed=sp.seed + i)

    for mode in ("greedy", "sampled"):
        sp = None if mode == "greedy" else sampled
        n_runs = args.repeats if mode == "greedy" else max(args.repeats, args.sampled_seeds)
        for task, ids in prompts.items():
            h.fill_tower(task, ids)
            todo = arms if mode == "greedy" else sampled_arms(arms, res, args)
            for arm in todo:
                if deadline.over():
                    res["truncated"] = True
                    return
                if mode == "greedy" and arm.get("sampled_only"):
                    continue
                if mode == "greedy" and arm.get("quantized") and not args.full:
                    best = best_block(res, "DFlash2 bf16 b")
                    if best is not None and arm["block"] != best:
                        continue
                kind, block = arm["kind"], arm["block"]
                width = block
                ahead = arm.get("ahead", True)
                rg = not arm.get("eager_rule")
                warm(kind, block, width, ids, sp, ahead, rg)
                # one untimed full run first: the last windows of a run draft fewer tokens, and each new draft count
                # is a new graph (and its kernels' first compile), which the short warm-up does not reach
                runs = [h.generate(ids, kind, block, width, args.new_tokens, sampling=seeded(sp, i), ahead=ahead,
                                   rule_graphs=rg, draft_temp_scale=arm.get("draft_temp_scale", 1.0))
                        for i in range(n_runs + 1)][1:]
                rec = record(runs)
                rec["draft_bytes"] = drafter_bytes(h, kind, block)
                rec["draft_bound_ms"] = 1e3 * rec["draft_bytes"] / res["copy_bandwidth_Bps"] if res.get(
                    "copy_bandwidth_Bps") else None
                if mode == "greedy":
                    toks = runs[0].token_ids
                    ref1 = target_ref(task, ids, 1)
                    rec["equal_width1"] = toks == ref1
                    rec["equal_same_width"] = toks == (ref1 if width == 1 or toks == ref1
                                                       else target_ref(task, ids, width))
                else:
                    rec["mean_logprob"] = mean_logprob(h, ids, runs[0].token_ids, sp)
                a = res["arms"].setdefault(arm["arm"], {k: v for k, v in arm.items() if k != "arm"})
                a.setdefault(mode, {})[task] = rec
                print(f"  {mode} {task:6s} {arm['arm']:26s} {rec['tok_s']:8.1f} tok/s  "
                      f"{rec['tokens_per_window']:.2f} tok/win  draft {rec['draft_ms']:.3f} ms  "
                      f"verify {rec['verify_ms']:.2f} ms  window {rec['window_ms']:.2f} ms", flush=True)


def best_block(res: dict[str, Any], prefix: str, task: str = "code") -> int | None:
    best = None
    for a in res["arms"].values():
        name = a.get("name", "")
        if not name.startswith(prefix):
            continue
        v = a.get("greedy", {}).get(task)
        if v and (best is None or v["tok_s"] > best[0]):
            best = (v["tok_s"], a["block"])
    return None if best is None else best[1]


def sampled_arms(arms: list[dict], res: dict[str, Any], args) -> list[dict]:
    if args.full:
        return arms
    keep = [arms[0]]
    for fam in ("mtp", "dflash2"):
        cands = [a for a in arms if a["family"] == fam and a["arm"] in res["arms"]]
        scored = [(a, res["arms"][a["arm"]].get("greedy", {}).get("code", {}).get("tok_s", 0.0)) for a in cands]
        if scored:
            keep.append(max(scored, key=lambda x: x[1])[0])
    # the eager-rule arms, each next to the same drafter and block with the rule's graphs
    for a in arms:
        if a.get("sampled_only"):
            twin = next((b for b in arms if b["kind"] == a["kind"] and b["block"] == a["block"]
                         and b["family"] in ("target", "mtp", "dflash2")), None)
            keep.extend(x for x in (twin, a) if x is not None and x not in keep)
    return keep


def speedups(res: dict[str, Any]) -> None:
    base = res["arms"].get("target-only", {})
    for a in res["arms"].values():
        for mode in ("greedy", "sampled"):
            for task, v in a.get(mode, {}).items():
                b = base.get(mode, {}).get(task, {}).get("tok_s")
                v["speedup"] = v["tok_s"] / b if b else None
                step1 = res.get("a3b", {}).get("step_ms", {}).get(1)
                v["draft_share_of_a3b_step"] = v["draft_ms"] / step1 if step1 else None


def goals(res: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    """The issue's bars, read off the greedy results (best arm of each family per task)."""
    def best(fam: str, task: str, mode: str = "greedy") -> tuple[str | None, float]:
        c = [(n, a[mode][task]["tok_s"]) for n, a in res["arms"].items()
             if a.get("family") == fam and task in a.get(mode, {})]
        return max(c, key=lambda x: x[1]) if c else (None, float("nan"))

    g: dict[str, Any] = {}
    for task in tasks:
        tgt = res["arms"].get("target-only", {}).get("greedy", {}).get(task, {}).get("tok_s", float("nan"))
        dn, dv = best("dflash2", task)
        mn, mv = best("mtp", task)
        g[task] = {"dflash2_best": dn, "dflash2_x_target": dv / tgt, "mtp_best": mn, "mtp_x_target": mv / tgt,
                   "dflash2_over_mtp": dv / mv - 1.0}
    code = g.get("code", {})
    shares = [v["draft_share_of_a3b_step"] for a in res["arms"].values() for v in a.get("greedy", {}).values()
              if v.get("draft_share_of_a3b_step") is not None and a.get("family") in ("mtp", "dflash2")]
    g["bars"] = {
        "dflash2 >= 2.0x target on code": code.get("dflash2_x_target", 0) >= 2.0,
        "dflash2 >= +30% over MTP on code": code.get("dflash2_over_mtp", -1) >= 0.30,
        "dflash2 >= MTP on every task": all(g[t]["dflash2_over_mtp"] >= 0 for t in tasks),
        "MTP >= 1.5x target on code": code.get("mtp_x_target", 0) >= 1.5,
        "max drafter cost per window / A3B step": max(shares) if shares else None,
    }
    return g


# ------------------------------------------------------------------------------------------------ check mode
def check(h: Harness, arms: list[dict], prompts: dict[str, list[int]], n: int) -> tuple[bool, list[list[Any]]]:
    rows, ok = [], True
    for task, ids in prompts.items():
        h.fill_tower(task, ids)
        widths = sorted({a["block"] for a in arms})
        refs = {w: h.generate(ids, None, 1, w, n).token_ids for w in widths}
        for w in (1, max(widths)):
            alone = h.generate(ids, None, 1, w, n, scaled=False).token_ids
            same = alone == refs[w]
            ok &= same
            rows.append([f"target-only w{w}: tower step == pack step", task, same, "-"])
        for arm in arms[1:]:
            got = h.generate(ids, arm["kind"], arm["block"], arm["block"], n).token_ids
            same = got == refs[arm["block"]]
            ok &= same
            rows.append([arm["arm"], task, same, got == refs[1]])
    return ok, rows


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--full", action="store_true", help="every arm sampled too, Q8_0/Q4_0 at every block, 3 repeats")
    ap.add_argument("--check", action="store_true", help="greedy equality on every arm and task (a few tokens)")
    ap.add_argument("--check-tokens", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tasks", default="code,math,prose,long")
    ap.add_argument("--shape", choices=("a3b", "tiny"), default="a3b", help="tiny: a toy tower for CPU smoke runs")
    ap.add_argument("--max-seconds", type=float, default=230)
    ap.add_argument("--sampled-seeds", type=int, default=1,
                    help="sampled rows over this many seeds (a trajectory each; medians), not one seed repeated")
    ap.add_argument("--sampled-temperature", type=float, default=SAMPLED.temperature)
    ap.add_argument("--sampled-top-p", type=float, default=SAMPLED.top_p)
    ap.add_argument("--extra-head", default="", metavar="PATH[:LABEL]",
                    help="another DFlash2 head for the pack's target, measured at blocks 4/6/8 beside the default")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.full else 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/spec_scale.py: no CUDA device; run it on a GPU or pass --device cpu --shape tiny.")
        return 2
    if not (NANO / "model.safetensors").is_file():
        print(f"the bundled pack is missing ({NANO}); nothing to measure.")
        return 2
    deadline = Deadline(args.max_seconds)
    t0 = time.perf_counter()
    h = Harness(args)
    texts = task_prompts()
    wanted = [t for t in args.tasks.split(",") if t]
    prompts = {t: h.tok.encode(texts[t]).ids for t in wanted}
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "arms": {}, "tower_build_s": h.tower_build_s,
                           "prompt_tokens": {t: len(v) for t, v in prompts.items()},
                           "target": "strata-nano (trained, decides every token) + A3B-shaped tower (cost; logits x 0)"}
    with tempfile.TemporaryDirectory() as td:
        gdir = load_drafters(h, Path(td), args.extra_head)
        arms = arm_list(h, gdir)
        for a in arms:
            a["name"] = a["arm"]
        if args.check:
            ok, rows = check(h, arms, prompts, args.check_tokens)
            print_table(f"spec_scale --check ({args.check_tokens} greedy tokens, same step width)",
                        ["arm", "task", "== target-only", "== width 1"], rows)
            res["check"] = {"ok": ok, "rows": rows}
            write_json("spec_scale_check.json", res)
            print("check:", "all equal" if ok else "MISMATCH (a speculative arm changed greedy output)")
            return 0 if ok else 1
        if h.cuda:
            bw = copy_bandwidth()
            res["copy_bandwidth_GBs"] = bw / 1e9
            res["copy_bandwidth_Bps"] = bw
        widths = list(range(1, 17))
        res["a3b"] = verify_cost(h, prompts.get("code") or next(iter(prompts.values())), widths,
                                 reps=10 if h.cuda else 2)
        a3 = res["a3b"]
        print_table("A3B-shaped step by window width (honest routing)",
                    ["width", "step ms", "x width 1", "distinct experts / layer", "independent top-k"],
                    [[w, a3["step_ms"][w], a3["relative"][w], a3["distinct_experts_per_layer"][w]["mean"],
                      a3["distinct_experts_per_layer"][w]["uniform"]] for w in widths])
        run_arms(h, arms, prompts, args, deadline, res)
    speedups(res)
    res["goals"] = goals(res, [t for t in wanted if t in prompts])
    res["seconds"] = time.perf_counter() - t0
    res["steps"] = {w: s.info() for w, s in h.steps.items()}
    res["drafter_graphs"] = {k: (None if getattr(d, "graphs", None) is None else
                                 {"enabled": d.graphs.enabled, "replays": d.graphs.replays, "errors": d.graphs.errors})
                             for k, d in h.drafters.items()}
    for mode in ("greedy", "sampled"):
        rows = []
        for name, a in res["arms"].items():
            for task, v in a.get(mode, {}).items():
                extra = v.get("equal_same_width") if mode == "greedy" else v.get("mean_logprob")
                rows.append([name, task, v["tok_s"], v["speedup"], v["tokens_per_window"], v["draft_ms"],
                             v["draft_bound_ms"], 100 * (v["draft_share_of_a3b_step"] or math.nan), v["verify_ms"],
                             v["window_ms"], extra])
        if rows:
            print_table(f"{mode}: strata-nano decides, A3B-shaped tower costs ({res['machine'].get('gpu') or 'cpu'}, "
                        f"{args.new_tokens} new tokens, median of {args.repeats})",
                        ["arm", "task", "tok/s", "x target", "tok/window", "draft ms", "bytes/bw ms",
                         "draft % A3B step", "verify ms", "window ms",
                         "== target" if mode == "greedy" else "mean logp"], rows)
    for k, v in res["goals"].get("bars", {}).items():
        print(f"  {k}: {v}")
    write_json("spec_scale.json", res)
    print(f"done in {res['seconds']:.0f} s" + (" (truncated by --max-seconds)" if res.get("truncated") else ""))
    del h
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
