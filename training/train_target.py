"""Stage 1: train the qwen3_moe target and its MTP head together on the corpus (next-token + next-next-token).

Loss = CE(next token) + `mtp_weight` * CE(MTP, token t+2) + `aux_weight` * switch load-balancing loss over every
router (read through forward hooks on the `mlp.gate` linears, so the runtime model needs no training-only code).
The model is the runtime's own `Qwen3MoeModel` (one definition of the architecture).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.models.layers import SparseMoe
from runtime.models.qwen3_moe import Qwen3MoeModel
from runtime.models.target_config import Qwen3MoeConfig
from training.common import Log, StepClock, autocast, lr_at, make_optimizer, sample_windows
from training.configs import Geometry, StageSettings, target_config


def build_target(g: Geometry, seed: int) -> Qwen3MoeModel:
    """A freshly initialised target: N(0, 0.02) matrices, residual outputs scaled by 1/sqrt(2 * layers)."""
    torch.manual_seed(seed)
    model = Qwen3MoeModel(Qwen3MoeConfig.from_dict(target_config(g)))
    resid = 0.02 / math.sqrt(2 * (g.layers + 1))
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        std = resid if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        nn.init.normal_(p, 0.0, std)
    return model


class RouterStats:
    """Collects router logits of every MoE block during a forward (for the load-balancing loss)."""

    def __init__(self, model: nn.Module) -> None:
        self.logits: list[Tensor] = []
        self.handles = [m.gate.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, SparseMoe)]
        self.top_k = next(m.top_k for m in model.modules() if isinstance(m, SparseMoe))

    def _hook(self, _mod, _inp, out: Tensor) -> None:
        self.logits.append(out)

    def balance_loss(self) -> Tensor:
        """Switch-style E * sum_e(fraction routed to e * mean router prob of e), averaged over routers (1 = even)."""
        losses = []
        for lg in self.logits:
            probs = F.softmax(lg.float().reshape(-1, lg.shape[-1]), dim=-1)
            n_exp = probs.shape[-1]
            top = torch.topk(probs, self.top_k, dim=-1).indices
            frac = F.one_hot(top, n_exp).float().sum(1).mean(0) / self.top_k
            losses.append(n_exp * (frac * probs.mean(0)).sum())
        self.logits.clear()
        return torch.stack(losses).mean()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def target_losses(model: Qwen3MoeModel, window: Tensor) -> tuple[Tensor, Tensor]:
    """CE of the next token and of the MTP's token t+2 on one batch of windows [B, T+1]."""
    x, y = window[:, :-1], window[:, 1:]
    out = model(x)
    V = out.logits.shape[-1]
    ce = F.cross_entropy(out.logits.float().reshape(-1, V), y.reshape(-1))
    mtp = model.mtp_logits(x, out.hidden)           # row p-1 predicts x[p+1]
    ce_mtp = F.cross_entropy(mtp.float().reshape(-1, V), window[:, 2:].reshape(-1))
    return ce, ce_mtp


@torch.no_grad()
def held_out_nll(model: Qwen3MoeModel, tokens: np.ndarray, seq: int, device: torch.device,
                 max_tokens: int, batch: int = 32) -> dict[str, float]:
    """Mean next-token NLL (and MTP NLL, top-1 accuracies) over non-overlapping windows of held-out tokens."""
    model.eval()
    n_win = max(1, min(tokens.size - 1, max_tokens) // seq)
    wins = [tokens[i * seq: i * seq + seq + 1] for i in range(n_win) if (i * seq + seq + 1) <= tokens.size]
    tot = {"nll": 0.0, "mtp_nll": 0.0, "acc": 0.0, "mtp_acc": 0.0}
    n = n_m = 0
    for b in range(0, len(wins), batch):
        w = torch.from_numpy(np.stack(wins[b: b + batch]).astype(np.int64)).to(device)
        with autocast(device):
            out = model(w[:, :-1])
            mtp = model.mtp_logits(w[:, :-1], out.hidden) if model.mtp is not None else None
        lg = out.logits.float()
        tot["nll"] += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        tot["acc"] += (lg.argmax(-1) == w[:, 1:]).sum().item()
        n += w[:, 1:].numel()
        if mtp is not None:
            m = mtp.float()
            tot["mtp_nll"] += F.cross_entropy(m.reshape(-1, m.shape[-1]), w[:, 2:].reshape(-1), reduction="sum").item()
            tot["mtp_acc"] += (m.argmax(-1) == w[:, 2:]).sum().item()
            n_m += w[:, 2:].numel()
    model.train()
    res = {"nll": tot["nll"] / n, "acc": tot["acc"] / n, "tokens": n}
    res["ppl"] = math.exp(res["nll"])
    if n_m:
        res.update(mtp_nll=tot["mtp_nll"] / n_m, mtp_acc=tot["mtp_acc"] / n_m)
    return res


def train_target(model: Qwen3MoeModel, train_tokens: np.ndarray, s: StageSettings, device: torch.device,
                 log: Log, *, seed: int, mtp_weight: float = 0.3, aux_weight: float = 0.01,
                 eval_tokens: np.ndarray | None = None, eval_every: int = 0, checkpoint=None,
                 checkpoint_every_s: float = 0) -> dict:
    """Train in place; returns the stage summary (steps, seconds, last losses). `checkpoint(model)` is called
    every `checkpoint_every_s` seconds so a later call can continue from the weights."""
    model.to(device).train()
    gen = np.random.default_rng(seed)
    opt = make_optimizer(model.named_parameters(), s.lr, s.weight_decay, device)
    router = RouterStats(model)
    clock = StepClock(s.steps, s.seconds)
    last_ckpt = time.time()
    losses: list[float] = []
    first = None
    step = 0
    while step < clock.update(step) and not clock.over():
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, clock.total, s.warmup, s.lr)
        w = sample_windows(train_tokens, s.batch, s.seq + 1, gen).to(device, non_blocking=True)
        with autocast(device):
            ce, ce_mtp = target_losses(model, w)
            aux = router.balance_loss()
            loss = ce + mtp_weight * ce_mtp + aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1 or step % 25 == 0 or step >= clock.total:
            row = {"ce": ce.item(), "ce_mtp": ce_mtp.item(), "aux": aux.item(), "gnorm": gnorm.item()}
            first = first or row
            losses.append(row["ce"])
            log(stage="target", step=step, total=clock.total, s=round(clock.elapsed, 1), **row)
        if eval_every and eval_tokens is not None and step % eval_every == 0:
            log(stage="target", step=step, held_out=held_out_nll(model, eval_tokens, s.seq, device, 32768))
        if checkpoint is not None and checkpoint_every_s and time.time() - last_ckpt > checkpoint_every_s:
            checkpoint(model)
            last_ckpt = time.time()
    router.close()
    model.eval()
    return {"steps": step, "seconds": round(clock.elapsed, 1), "s_per_step": round(clock.elapsed / max(1, step), 4),
            "tokens": step * s.batch * s.seq, "first": first, "last_ce": losses[-1] if losses else None}
