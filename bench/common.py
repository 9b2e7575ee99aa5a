"""Shared pieces of the GPU benchmarks: where results go, what machine ran them, a rich table, the copy bandwidth,
the bf16 matmul peak, the calibration prompts, a wall-clock budget so one device call ends in time, and the
Qwen3-30B-A3B-shaped random target (with honest routing, below).

Honest routing. A random A3B-shaped model with every weight at std 0.02 routes almost every token to the same
experts (a 16-token window touches about 18 distinct experts of 128 per layer): each layer's attention output
(std ~1) swamps the token's own embedding (std 0.02), and attention averages over positions, so every row's router
input is nearly the same. That flatters verify windows, the grouped kernels and expert caches. `honest=True` draws
the embeddings at std 1 and scales each layer's contributions to the residual (attention o_proj and the experts'
down_proj) by 0.05: a token's router input stays its own, and a 16-token window touches about 82 experts per layer,
what independent top-8 choices give (128 * (1 - (1 - 8/128)^16) = 82.4). Real models sit between the two; quote
which one a figure used, with `distinct_experts` (distinct experts per layer for a window of W tokens)."""

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


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of repeats)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
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


# ------------------------------------------------------------------------------------- the A3B-shaped target
A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "eos_token_id": 151645, "bos_token_id": None,
}
HONEST_EMBED_STD = 1.0     # honest routing: the embeddings' std
HONEST_RESIDUAL = 0.05     # honest routing: o_proj's and the experts' down_proj's std, relative to `std`


def build_random_on_gpu(cfg_json: dict, seed: int = 0, std: float = 0.02, device: str = "cuda", *,
                        honest: bool = False):
    """Our model with random BF16 weights created on the device (no CPU copy); experts stacked per layer.
    honest: embeddings at std HONEST_EMBED_STD, o_proj and the experts' down_proj at HONEST_RESIDUAL * std, so the
    router sees each token (module docstring, "Honest routing")."""
    from torch import nn

    from runtime.models.layers import Rotary, SparseMoe
    from runtime.models.qwen3_moe import Qwen3MoeModel
    from runtime.models.target_config import Qwen3MoeConfig

    dev = torch.device(device)
    cfg = Qwen3MoeConfig.from_dict(cfg_json)
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    res_std = std * HONEST_RESIDUAL if honest else std

    def rand(*shape: int, sd: float = std) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16, device=dev).normal_(0.0, sd, generator=g)

    for layer in model.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            gu = rand(mlp.n_exp, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
            dn = rand(mlp.n_exp, cfg.hidden_size, cfg.moe_intermediate_size, sd=res_std)
            inter = cfg.moe_intermediate_size
            for e, ex in enumerate(mlp.experts):
                ex.gate_proj.weight = nn.Parameter(gu[e, :inter], requires_grad=False)
                ex.up_proj.weight = nn.Parameter(gu[e, inter:], requires_grad=False)
                ex.down_proj.weight = nn.Parameter(dn[e], requires_grad=False)
            mlp.gate_up, mlp.down = gu, dn
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner)
        if "norm" in name:
            val = torch.ones(p.shape, dtype=torch.bfloat16, device=dev)
        elif honest and name == "model.embed_tokens.weight":
            val = rand(*p.shape, sd=HONEST_EMBED_STD)
        elif honest and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
            val = rand(*p.shape, sd=res_std)
        else:
            val = rand(*p.shape)
        setattr(mod, attr, nn.Parameter(val, requires_grad=False))
    model.rotary = Rotary(cfg).to(dev)
    return model.eval()


@torch.no_grad()
def distinct_experts(model, ids: list[int] | torch.Tensor, width: int) -> dict[str, Any]:
    """Distinct experts per MoE layer that windows of `width` consecutive tokens of `ids` touch (one forward over
    `ids`; each layer's top-k read from its router), averaged over the non-overlapping windows; `uniform` is what
    independent uniform top-k choices give."""
    from runtime.models.layers import SparseMoe

    ids_t = torch.as_tensor(ids, dtype=torch.long, device=model.lm_head.weight.device).reshape(1, -1)
    picks: list[torch.Tensor] = []
    hooks = []
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)]
    if not moe:
        return {"width": width, "per_layer": [], "mean": float("nan"), "uniform": float("nan")}
    k, E = moe[0].top_k, moe[0].n_exp
    for m in moe:
        hooks.append(m.gate.register_forward_hook(lambda mod, inp, out: picks.append(out.topk(k, dim=-1).indices)))
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
