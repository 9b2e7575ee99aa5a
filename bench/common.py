"""Shared pieces of the GPU benchmarks: where results go, what machine ran them, a rich table, the copy bandwidth,
the bf16 matmul rate, the calibration prompts, a wall-clock budget so one device call ends in time, and the
A3B-shaped random target (honest routing by default) with `distinct_experts`, the routing figure to quote next to
any result on it."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NANO = ROOT / "setup_wizard" / "bundled" / "strata-nano"
NANO_DFLASH2 = ROOT / "setup_wizard" / "bundled" / "strata-nano-dflash2"
PROMPTS = ROOT / "calibrate" / "prompts"


def out_dir() -> Path:
    """$OUT when set (the device machine), else bench/results/."""
    d = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    d.mkdir(parents=True, exist_ok=True)
    return d


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "platform": platform.platform(), "cpu": platform.processor() or platform.machine()}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mem_mib=p.total_memory >> 20, sms=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    return info


def write_json(name: str, data: dict[str, Any]) -> Path:
    path = out_dir() / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    return path


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c not in (columns[0],) else "left")
    for r in rows:
        t.add_row(*[fmt(v) for v in r])
    Console(width=160).print(t)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of repeats); on
    "cpu", memory to memory with torch's threads (wall clock)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    if device == "cpu":
        for _ in range(repeats):
            t0 = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - t0)
        return 2 * nbytes / median(times)
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * nbytes / median(times)


def matmul_peak(n: int = 8192, repeats: int = 10) -> float:
    """Dense bf16 matmul rate in FLOP/s (an n x n x n product, median of repeats)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / median(times)


def task_prompts() -> dict[str, str]:
    """The four calibration task prompts (code, long, math, prose)."""
    return {p.stem: p.read_text() for p in sorted(PROMPTS.glob("*.txt"))}


class Deadline:
    """A wall-clock budget: `left()` seconds remain; `over()` once spent."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


# ----------------------------------------------------------------------------------------------- the A3B shape
# Qwen3-30B-A3B's geometry (48 layers, 128 experts top-8, hidden 2048, expert width 768, 32 q / 4 kv heads x 128)
A3B_SHAPE = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "eos_token_id": 151645, "bos_token_id": None,
}

# Honest routing (/work/shared/peers/README.md, "Honest routing on random weights"): with every weight at std 0.02 a
# random model routes almost every token to the same experts (attention output swamps the token's embedding), which
# flatters any expert cache. Embeddings at std 1 and each layer's contributions to the residual (attention output
# projection, experts' down projections) scaled by 0.05 make the router's choices vary per token as independent
# top-k choices would (about 82 distinct experts of 128 per layer in a 16-token window).
HONEST = {"embed_std": 1.0, "residual_scale": 0.05}


def _gen(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def build_random_a3b(cfg_json: dict | None = None, *, device: str = "cuda", seed: int = 0, std: float = 0.02,
                     honest: bool = True, experts: str = "device", dtype: torch.dtype = torch.bfloat16):
    """A random model of the A3B shape (or `cfg_json`), built on `device` without a CPU copy of the dense weights.

    `experts="device"`: each MoE layer's experts stacked on the device (the all-resident layout);
    `experts="arena"`: generated on the device one layer at a time and moved into a host `ExpertArena` (pinned on
    CUDA hosts), the experts' parameters becoming views of it: the starting point of an offloaded cache.
    Every tensor has its own seed, so both give the same weights. Returns (model, arena or None)."""
    from torch import nn

    from runtime.expert_arena import ExpertArena
    from runtime.models.layers import Rotary, SparseMoe
    from runtime.models.qwen3_moe import Qwen3MoeModel
    from runtime.models.target_config import Qwen3MoeConfig

    dev = torch.device(device)
    cfg = Qwen3MoeConfig.from_dict(cfg_json or A3B_SHAPE)
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    scale = HONEST["residual_scale"] if honest else 1.0
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    planes: dict[int, dict[str, torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoe):
            continue
        g = _gen(dev, seed * 1_000_003 + 7919 * (i + 1))
        gu = torch.empty(mlp.n_exp, 2 * inter, hidden, dtype=dtype, device=dev).normal_(0.0, std, generator=g)
        dn = torch.empty(mlp.n_exp, hidden, inter, dtype=dtype, device=dev).normal_(0.0, std * scale, generator=g)
        if experts == "arena":
            hgu = torch.empty(gu.shape, dtype=dtype)
            hdn = torch.empty(dn.shape, dtype=dtype)
            hgu.copy_(gu)
            hdn.copy_(dn)
            del gu, dn
            gu, dn = hgu, hdn
            planes[i] = {"gate_up": gu, "down": dn}
        for e, ex in enumerate(mlp.experts):
            ex.gate_proj.weight = nn.Parameter(gu[e, :inter], requires_grad=False)
            ex.up_proj.weight = nn.Parameter(gu[e, inter:], requires_grad=False)
            ex.down_proj.weight = nn.Parameter(dn[e], requires_grad=False)
        if experts == "device":
            mlp.gate_up, mlp.down = gu, dn
    for j, (name, p) in enumerate(list(model.named_parameters())):
        if not p.is_meta:
            continue
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner)
        if "norm" in name:
            val = torch.ones(p.shape, dtype=dtype, device=dev)
        else:
            s = std
            if name == "model.embed_tokens.weight" and honest:
                s = HONEST["embed_std"]
            elif name.endswith("self_attn.o_proj.weight"):
                s = std * scale
            val = torch.empty(p.shape, dtype=dtype, device=dev).normal_(0.0, s, generator=_gen(dev, seed * 31 + j))
        setattr(mod, attr, nn.Parameter(val, requires_grad=False))
    model.rotary = Rotary(cfg).to(dev)
    for layer in model.model.layers:      # as ExpertCache.place does: q/k/v stacked now, not at the first step
        layer.self_attn.stack_qkv()
    if dev.type == "cuda":
        torch.cuda.empty_cache()          # the unstacked copies' segments
    arena = None
    if experts == "arena":
        arena = ExpertArena(planes)
        if dev.type == "cuda":
            arena.pin()
    return model.eval(), arena


@torch.no_grad()
def distinct_experts(model, ids: list[int] | torch.Tensor, width: int) -> dict[str, Any]:
    """Distinct experts per MoE layer that windows of `width` consecutive tokens of `ids` touch (one forward over
    `ids`; each layer's top-k read from its router), the median over the non-overlapping windows; `uniform` is what
    independent uniform top-k choices give (E * (1 - (1 - k/E)^width): 82.4 for 16 tokens, top-8 of 128)."""
    from runtime.models.layers import SparseMoe

    ids_t = torch.as_tensor(ids, dtype=torch.long, device=model.lm_head.weight.device).reshape(1, -1)
    picks: list[torch.Tensor] = []
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)]
    if not moe:
        return {"width": width, "per_layer": [], "mean": float("nan"), "uniform": float("nan")}
    k, E = moe[0].top_k, moe[0].n_exp
    hooks = [m.gate.register_forward_hook(lambda mod, inp, out: picks.append(out.topk(k, dim=-1).indices))
             for m in moe]
    try:
        model(ids_t, logits_to_keep=-1)
    finally:
        for h in hooks:
            h.remove()
    n = ids_t.shape[1] // width
    per_layer = []
    for p in picks:
        rows = p.reshape(-1, k)[: n * width].reshape(n, width * k)
        per_layer.append(float(median([float(torch.unique(r).numel()) for r in rows])) if n else float("nan"))
    return {"width": width, "windows": n, "per_layer": per_layer, "mean": sum(per_layer) / len(per_layer),
            "min": min(per_layer), "max": max(per_layer), "uniform": E * (1 - (1 - k / E) ** width)}
