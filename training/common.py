"""Small shared pieces of the training stages: seeding, batches, schedule, optimiser, logging, BF16 export."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor, nn


def seed_all(seed: int) -> None:
    """Deterministic seeds for torch (CPU and CUDA) and numpy."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device: torch.device):
    """BF16 autocast on CUDA (master weights stay fp32); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def sample_windows(tokens: np.ndarray, batch: int, length: int, gen: np.random.Generator) -> Tensor:
    """`batch` random windows of `length` tokens from one long token array (int64 [batch, length])."""
    hi = tokens.size - length
    if hi <= 0:
        raise ValueError(f"corpus of {tokens.size} tokens is shorter than one window of {length}.")
    starts = gen.integers(0, hi, size=batch)
    idx = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float = 0.1) -> float:
    """Linear warmup, then cosine decay to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(params: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float,
                   device: torch.device) -> torch.optim.Optimizer:
    """AdamW; matrices decay, norms/kernels/codebook vectors of rank < 2 do not."""
    decay, no_decay = [], []
    for _, p in params:
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kw)


class StepClock:
    """Decides how many steps a stage runs: `steps`, or fewer when `seconds` would be exceeded.

    After `probe` steps the measured pace fixes the total (so the cosine schedule has a known end); the
    log records it, and rerunning with that step count reproduces the stage.
    """

    def __init__(self, steps: int, seconds: float, probe: int = 30) -> None:
        self.total, self.seconds, self.probe = steps, seconds, probe
        self.t0 = time.time()
        self.t_mid: float | None = None
        self.fixed = False

    def update(self, step: int) -> int:
        """Called before each step; the pace is measured over steps probe/2..probe (past the warm-up)."""
        if self.fixed:
            return self.total
        if step == self.probe // 2:
            self.t_mid = time.time()
        elif step == self.probe and self.t_mid is not None:
            now = time.time()
            pace = (now - self.t_mid) / (self.probe - self.probe // 2)
            more = int((self.seconds - (now - self.t0)) / pace)
            self.total = max(step + 1, min(self.total, step + more))
            self.fixed = True
        return self.total

    def over(self) -> bool:
        return time.time() - self.t0 > self.seconds * 1.05

    @property
    def elapsed(self) -> float:
        return time.time() - self.t0


class Log:
    """Prints JSON lines and keeps them (written next to the outputs)."""

    def __init__(self, path: Path | None = None, quiet: bool = False) -> None:
        self.path, self.quiet, self.rows = path, quiet, []

    def __call__(self, **row) -> None:
        row = {"t": round(time.time(), 1), **row}
        self.rows.append(row)
        line = json.dumps(row)
        if not self.quiet:
            print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")


def save_bf16(state: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a BF16 safetensors file atomically (temp name, then rename)."""
    out = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state.items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp), metadata={"format": "pt", **(metadata or {})})
    os.chmod(tmp, 0o644)
    tmp.replace(path)


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
