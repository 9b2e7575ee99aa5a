"""Stage 2: the drafters' training data — the frozen target's own greedy continuations of corpus prompts.

Speculative decoding accepts a proposal only when it equals the target's greedy token, so the drafters learn
from what the target actually generates (self-distillation), not from the corpus text. Also the MTP fine-tune
(stage 3), which trains only the `mtp.*` parameters on these continuations with the target frozen.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from runtime.kv import KVCache
from runtime.models.qwen3_moe import Qwen3MoeModel
from training.common import Log, StepClock, autocast, lr_at, make_optimizer
from training.configs import StageSettings


@torch.no_grad()
def greedy_continue(model: Qwen3MoeModel, prompts: torch.Tensor, n_new: int, device: torch.device) -> torch.Tensor:
    """Batched greedy decoding with the runtime's static KV cache: [B, P] -> [B, P + n_new]."""
    cfg = model.cfg
    B, P = prompts.shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, P + n_new, batch=B,
                 dtype=dtype, device=device)
    seq = prompts.to(device)
    out_tokens = [seq]
    with autocast(device):
        out = model(seq, kv=kv, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(n_new - 1):
            out_tokens.append(nxt)
            out = model(nxt, kv=kv, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        out_tokens.append(nxt)
    return torch.cat(out_tokens, dim=1).cpu()


def make_distill_set(model: Qwen3MoeModel, train_tokens: np.ndarray, n_prompts: int, prompt_len: int,
                     n_new: int, device: torch.device, log: Log, *, seed: int, batch: int = 512,
                     seconds: float = 1e9) -> torch.Tensor:
    """[N, prompt_len + n_new] int64: random corpus prompts continued greedily (stops early at `seconds`)."""
    model.eval()
    gen = np.random.default_rng(seed)
    starts = gen.integers(0, train_tokens.size - prompt_len, size=n_prompts)
    prompts = torch.from_numpy(np.stack([train_tokens[s: s + prompt_len] for s in starts]).astype(np.int64))
    t0 = time.time()
    parts = []
    for b in range(0, n_prompts, batch):
        parts.append(greedy_continue(model, prompts[b: b + batch], n_new, device))
        log(stage="distill", sequences=b + parts[-1].shape[0], s=round(time.time() - t0, 1))
        if time.time() - t0 > seconds:
            break
    return torch.cat(parts)


def train_mtp(model: Qwen3MoeModel, seqs: torch.Tensor, prompt_len: int, s: StageSettings, device: torch.device,
              log: Log, *, seed: int) -> dict:
    """Fine-tune `mtp.*` only (target frozen) on the continuations: the head's token t+2 is the target's own
    greedy token there. Loss only on rows whose label lies in the generated part."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    model.to(device).train()
    opt = make_optimizer([(n, p) for n, p in model.named_parameters() if p.requires_grad], s.lr, s.weight_decay,
                         device)
    gen = torch.Generator().manual_seed(seed)
    clock = StepClock(s.steps, s.seconds)
    L = min(s.seq + 1, seqs.shape[1])
    lo = max(0, prompt_len - L // 2)
    step, first, last = 0, None, None
    while step < clock.update(step) and not clock.over():
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, clock.total, s.warmup, s.lr)
        rows = torch.randint(0, seqs.shape[0], (s.batch,), generator=gen)
        off = int(torch.randint(lo, seqs.shape[1] - L + 1, (1,), generator=gen))
        w = seqs[rows, off: off + L].to(device)
        with torch.no_grad(), autocast(device):
            hidden = model(w[:, :-1], logits_to_keep=-1).hidden
        with autocast(device):
            mtp = model.mtp_logits(w[:, :-1], hidden.detach()).float()   # row j predicts w[j + 2]
        labels = w[:, 2:].clone()
        gen_from = prompt_len - off            # absolute index >= prompt_len is generated
        labels[:, : max(0, gen_from - 2)] = -100
        loss = F.cross_entropy(mtp.reshape(-1, mtp.shape[-1]), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        step += 1
        if step == 1 or step % 25 == 0 or step >= clock.total:
            last = loss.item()
            first = first if first is not None else last
            log(stage="mtp", step=step, total=clock.total, s=round(clock.elapsed, 1), ce=last)
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return {"steps": step, "seconds": round(clock.elapsed, 1), "s_per_step": round(clock.elapsed / max(1, step), 4),
            "first_ce": first, "last_ce": last}


@torch.no_grad()
def mtp_agreement(model: Qwen3MoeModel, seqs: torch.Tensor, prompt_len: int, device: torch.device,
                  batch: int = 64) -> dict[str, float]:
    """On greedy continuations: how often the target's teacher-forced argmax reproduces its own continuation
    (a consistency check, ~1) and how often the MTP head's first proposal equals the target's token t+2."""
    model.eval()
    agree = mtp_ok = n = 0
    for b in range(0, seqs.shape[0], batch):
        w = seqs[b: b + batch].to(device)
        with autocast(device):
            out = model(w)
            mtp = model.mtp_logits(w, out.hidden)
        lab = w[:, prompt_len:]
        agree += (out.logits[:, prompt_len - 1: -1].argmax(-1) == lab).sum().item()
        mtp_ok += (mtp[:, prompt_len - 2: -1].argmax(-1) == lab).sum().item()
        n += lab.numel()
    return {"target_self_agreement": agree / n, "mtp_top1": mtp_ok / n, "tokens": n}
