"""Stage 4: train a DFlash2 head on the frozen target's taps (the runtime's own `DFlash2Model`).

Data: the target's greedy continuations (distill.py). Per sequence, random anchors P in the generated part; the
window is [x[P], mask, ..., mask] at positions P..P+W-1 and sees the taps of positions 0..P-1 (exactly what the
drafter has at inference: the committed context, the anchor being the last committed token).
Loss = position-decayed cross-entropy of rows 1..W-1 against x[P+1..P+W-1] (weight exp(-(k-1)/decay) for the
k-th row) + `selector_weight` * the selector's cross-entropy over its top-k candidates, teacher-forced with the
true predecessor (rows whose true token is not among the candidates are skipped).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.drafters.dflash2.model import DFlash2Model
from runtime.models.qwen3_moe import Qwen3MoeModel
from training.common import Log, StepClock, autocast, lr_at, make_optimizer
from training.configs import DraftSettings
from training.tok import MASK


def build_drafter(config: dict, seed: int) -> DFlash2Model:
    """A fresh DFlash2 head: N(0, 0.02) matrices (residual outputs scaled down), convolutions that start as the
    identity (base kernel 1 at offset 0, small dynamic projection), predecessor codebook N(0, 1) and a zero
    successor codebook (so the selector starts as plain top-1 and both codebooks still receive gradient)."""
    torch.manual_seed(seed)
    geom = DFlash2Geometry.from_config(config)
    m = DFlash2Model(geom)
    resid = 0.02 / math.sqrt(2 * geom.num_layers)
    for name, p in m.named_parameters():
        if name.endswith("base_kernel"):
            with torch.no_grad():
                p.zero_()
                p[:, 0, :] = 1.0
        elif name.endswith("kernel_projection.weight"):
            nn.init.normal_(p, 0.0, 0.002)
        elif name.endswith("predecessor_codebook"):
            nn.init.normal_(p, 0.0, 1.0)
        elif name.endswith("successor_codebook"):
            nn.init.zeros_(p)
        elif name.endswith("hidden_projection.weight"):
            nn.init.normal_(p, 0.0, geom.hidden_size**-0.5)
        elif p.dim() >= 2:
            nn.init.normal_(p, 0.0, resid if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
    return m


def sample_anchors(n_seq: int, per_seq: int, lo: int, hi: int, gen: torch.Generator) -> Tensor:
    """[n_seq, per_seq] anchor positions uniform in [lo, hi]."""
    return torch.randint(lo, hi + 1, (n_seq, per_seq), generator=gen)


def window_batch(seqs: Tensor, anchors: Tensor, width: int, mask_id: int = MASK) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flatten anchors [S, N] into windows: block ids [S*N, W] (anchor + masks), positions [S*N, W],
    labels [S*N, W-1] (true tokens at P+1..P+W-1), predecessors [S*N, W-1] (tokens at P..P+W-2)."""
    S, N = anchors.shape
    dev = seqs.device
    rows = torch.arange(S, device=dev).repeat_interleave(N)
    p = anchors.reshape(-1).to(dev)
    offs = torch.arange(width, device=dev)
    pos = p[:, None] + offs[None]
    toks = seqs[rows[:, None], pos]
    ids = torch.full_like(toks, mask_id)
    ids[:, 0] = toks[:, 0]
    return ids, pos, toks[:, 1:], toks[:, :-1]


def draft_losses(drafter: DFlash2Model, target: Qwen3MoeModel, seqs: Tensor, anchors: Tensor, width: int,
                 decay: float, taps: Tensor | None = None) -> dict[str, Tensor]:
    """Losses and simple accuracies for one batch of sequences [S, L] with anchors [S, N]."""
    S, L = seqs.shape
    N = anchors.shape[1]
    if taps is None:
        with torch.no_grad():
            taps = target(seqs, taps=drafter.geom.target_layer_ids, logits_to_keep=-1).taps
    ids, pos, labels, prev = window_batch(seqs, anchors, width, drafter.geom.mask_token_id)
    ctx = taps.repeat_interleave(N, dim=0)
    out = drafter(ctx, torch.arange(L, device=seqs.device), ids, pos, embed=target.model.embed_tokens,
                  lm_head=target.lm_head, ctx_lengths=anchors.reshape(-1).to(seqs.device))
    V = out.logits.shape[-1]
    wts = torch.exp(-torch.arange(width - 1, device=seqs.device, dtype=torch.float32) / decay)
    wts = (wts / wts.sum()).expand(labels.shape)
    ce = F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1), reduction="none").view_as(labels)
    ce = (ce * wts).sum(-1).mean()
    scores, cand = drafter.selector_scores(out.hs, out.logits, prev)
    hit = cand == labels[..., None]
    has = hit.any(-1)
    tgt = hit.float().argmax(-1)
    sel = F.cross_entropy(scores.float().reshape(-1, scores.shape[-1]), tgt.reshape(-1), reduction="none")
    sel = (sel.view_as(labels) * wts * has).sum() / (wts * has).sum().clamp_min(1e-6)
    with torch.no_grad():
        top1 = (out.logits.argmax(-1) == labels).float().mean()
        pick = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        sel_acc = (pick == labels).float().mean()
    return {"ce": ce, "sel": sel, "top1": top1, "sel_acc": sel_acc, "recall": has.float().mean()}


@torch.no_grad()
def greedy_draft(drafter: DFlash2Model, target: Qwen3MoeModel, seqs: Tensor, anchors: Tensor, width: int,
                 taps: Tensor) -> Tensor:
    """Greedy selector-walk proposals [S*N, W-1] for every anchor (batched version of the runtime's walk)."""
    S, L = seqs.shape
    N = anchors.shape[1]
    ids, pos, _, _ = window_batch(seqs, anchors, width, drafter.geom.mask_token_id)
    out = drafter(taps.repeat_interleave(N, dim=0), torch.arange(L, device=seqs.device), ids, pos,
                  embed=target.model.embed_tokens, lm_head=target.lm_head,
                  ctx_lengths=anchors.reshape(-1).to(seqs.device))
    sel = drafter.candidate_selector
    unary, cand = torch.topk(out.logits.float(), sel.top_k, dim=-1)
    hp = sel.hidden_projection(out.hs).float()
    prev = ids[:, 0]
    picks = []
    for r in range(width - 1):
        a = sel.predecessor_codebook[prev].float() * hp[:, r]
        score = unary[:, r] + torch.einsum("bkr,br->bk", sel.successor_codebook[cand[:, r]].float(), a)
        prev = cand[:, r].gather(-1, score.argmax(-1, keepdim=True))[:, 0]
        picks.append(prev)
    return torch.stack(picks, dim=1)


@torch.no_grad()
def window_acceptance(drafter: DFlash2Model, target: Qwen3MoeModel, seqs: Tensor, prompt_len: int, width: int,
                      device: torch.device, *, per_seq: int = 8, seed: int = 0, batch: int = 32) -> dict[str, float]:
    """Mean tokens per window (accepted prefix + bonus) of greedy drafting against the target's own greedy
    continuations: anchors in the generated part, proposals compared with the tokens that follow."""
    drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    acc_sum, n = 0.0, 0
    for b in range(0, seqs.shape[0], batch):
        s = seqs[b: b + batch].to(device)
        anchors = sample_anchors(s.shape[0], per_seq, max(1, prompt_len - 1), s.shape[1] - width, gen)
        with autocast(device):
            taps = target(s, taps=drafter.geom.target_layer_ids, logits_to_keep=-1).taps
            picks = greedy_draft(drafter, target, s, anchors, width, taps)
        _, _, labels, _ = window_batch(s, anchors, width)
        ok = (picks == labels).long().cumprod(dim=1).sum(1)
        acc_sum += (ok + 1).float().sum().item()
        n += ok.numel()
    drafter.train()
    return {"tokens_per_window": acc_sum / max(1, n), "windows": n, "block": width}


def train_dflash(drafter: DFlash2Model, target: Qwen3MoeModel, seqs: Tensor, prompt_len: int, s: DraftSettings,
                 device: torch.device, log: Log, *, seed: int, stage: str = "dflash2", checkpoint=None) -> dict:
    """Train the drafter in place (target frozen). `s.seq` is the sequence length used (cropped from the
    distilled sequences); `s.block` the window width."""
    target.to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    drafter.to(device).train()
    opt = make_optimizer(drafter.named_parameters(), s.lr, s.weight_decay, device)
    gen = torch.Generator().manual_seed(seed)
    clock = StepClock(s.steps, s.seconds)
    L = min(s.seq, seqs.shape[1])
    W = s.block
    step, first, last = 0, None, None
    while step < clock.update(step) and not clock.over():
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, clock.total, s.warmup, s.lr)
        rows = torch.randint(0, seqs.shape[0], (s.batch,), generator=gen)
        off = int(torch.randint(0, seqs.shape[1] - L + 1, (1,), generator=gen))
        batch = seqs[rows, off: off + L].to(device)
        lo = max(1, prompt_len - 1 - off)
        anchors = sample_anchors(s.batch, s.anchors, lo, L - W, gen)
        with autocast(device):
            parts = draft_losses(drafter, target, batch, anchors, W, s.decay)
            loss = parts["ce"] + s.selector_weight * parts["sel"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1 or step % 25 == 0 or step >= clock.total:
            last = {k: round(v.item(), 4) for k, v in parts.items()}
            first = first or last
            log(stage=stage, step=step, total=clock.total, s=round(clock.elapsed, 1), gnorm=round(gnorm.item(), 3),
                **last)
        if checkpoint is not None and step % 500 == 0:
            checkpoint(drafter)
    for p in target.parameters():
        p.requires_grad_(True)
    drafter.eval()
    return {"steps": step, "seconds": round(clock.elapsed, 1), "s_per_step": round(clock.elapsed / max(1, step), 4),
            "first": first, "last": last}


def drafter_state(drafter: DFlash2Model) -> dict[str, Tensor]:
    """The checkpoint tensors (the 81-tensor contract for L=5): every persistent parameter."""
    return {k: v for k, v in drafter.state_dict().items()}
