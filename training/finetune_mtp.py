"""Stage 7 (optional): fine-tune the target's MTP head for the chain the runtime drafts with.

The runtime chains the one MTP layer: a window's first draft comes from (the anchor, the target's hidden state),
every later draft from (the previous draft, the head's own output), its row attending over the committed rows and
the chain's earlier rows (runtime/drafters/mtp.py). Stages 1 and 3 trained only the first of these steps, teacher
forced, on the corpus and on long continuations where a small target loops. This stage trains every step of a chain
of `--depth` exactly as the runtime runs it (`chain_logits`: each depth's rows fed the previous depth's outputs and
attending over the committed rows up to the window's anchor plus the chain's own rows), with the target frozen and
its greedy token at each position as the label (what verification accepts), on short greedy continuations of many
prompts. Only `mtp.*` changes; the target's weights, and so its outputs, stay bit for bit the same.

    python -m training.finetune_mtp --out OUT [--seconds 150 --depth 3]    # on a GPU: writes OUT/mtp_head.safetensors
    python -m training.finetune_mtp --merge OUT/mtp_head.safetensors         # CPU: into the bundled target, then
    python -m training.pin                                                   # re-pin the catalog
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from runtime.loading import load_target
from runtime.models.layers import apply_rope
from runtime.models.qwen3_moe import Qwen3MoeModel
from training import corpus
from training.common import (
    Log,
    StepClock,
    autocast,
    lr_at,
    make_optimizer,
    pick_device,
    save_bf16,
    seed_all,
    write_json,
)
from training.distill import make_distill_set

# how much each depth's loss counts: the later drafts are reached less often (only after the earlier are accepted)
DEPTH_WEIGHTS = (1.0, 0.8, 0.6, 0.5, 0.4)


def chain_mask(n: int, depth: int, device: torch.device) -> Tensor:
    """[n, depth * n] bool, True where a depth-`depth` row may look: its keys are the depth-1 (committed) rows up to
    its window's anchor (row i - depth + 1) and, for each later depth e, the one row of that depth in its own chain
    (row i - depth + e), its own last."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    blocks = [j <= i - (depth - 1)]
    blocks += [j == i - (depth - e) for e in range(2, depth + 1)]
    return torch.cat(blocks, -1)


def chain_logits(model: Qwen3MoeModel, ids: Tensor, hidden: Tensor, depth: int) -> list[Tensor]:
    """The MTP chain over whole sequences: ids [B, T], hidden [B, T, H] the target's final hidden states. Returns
    one [B, T-1, V] logits tensor per depth; row i is the step at position i + 1 and predicts ids[i + 2]'s slot
    (the token after position i + 1). Depth 1 is `Qwen3MoeModel.mtp_logits`: (ids[p], hidden[p - 1]) attending
    causally. Depth d's row at position p takes (ids[p], depth d-1's output at p - 1), as the runtime's chain takes
    (its last draft, its last output), and attends as that chain step does (`chain_mask`). Rows i < d - 1 have no
    chain of that depth (their outputs are not used)."""
    mtp = model.mtp
    layer = mtp.layers[0]
    at = layer.self_attn
    B, T = ids.shape
    n = T - 1
    pos = torch.arange(1, T, device=ids.device)[None]
    cos, sin = model.rotary(pos, hidden.dtype)
    ne = mtp.pre_fc_norm_embedding(model.model.embed_tokens(ids[:, 1:]))
    g = hidden[:, :-1]
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    out = []
    for d in range(1, depth + 1):
        x = mtp.fc(torch.cat((ne, mtp.pre_fc_norm_hidden(g.to(ne.dtype))), -1))
        a = layer.input_layernorm(x)
        q = at.q_norm(at.q_proj(a).view(B, n, at.nh, at.hd)).transpose(1, 2)
        k = at.k_norm(at.k_proj(a).view(B, n, at.nkv, at.hd)).transpose(1, 2)
        v = at.v_proj(a).view(B, n, at.nkv, at.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ks.append(k)
        vs.append(v)
        if d == 1:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=at.scale,
                                               enable_gqa=at.nkv != at.nh)
        else:
            kk, vv = torch.cat(ks, 2), torch.cat(vs, 2)
            if at.nkv != at.nh:            # the math path with an explicit mask: repeat the KV heads
                kk = kk.repeat_interleave(at.nh // at.nkv, 1)
                vv = vv.repeat_interleave(at.nh // at.nkv, 1)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=chain_mask(n, d, ids.device), scale=at.scale)
        x = x + at.o_proj(o.transpose(1, 2).reshape(B, n, at.nh * at.hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = mtp.norm(x)
        out.append(model.lm_head(h))
        g = torch.cat((torch.zeros_like(h[:, :1]), h[:, :-1]), 1)      # depth d + 1 at p takes depth d's at p - 1
    return out


def chain_losses(model: Qwen3MoeModel, w: Tensor, depth: int, first: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """Per depth: the cross-entropy against the target's own greedy tokens and the top-1 hits (bool [B, rows]),
    over rows whose chain starts (its anchor) at position `first` or later."""
    with torch.no_grad():
        out = model(w)
        labels = out.logits.argmax(-1)[:, 1:]            # row i (position i + 1): the target's token after it
        hidden = out.hidden
    logits = chain_logits(model, w, hidden, depth)
    losses, hits = [], []
    for d, lg in enumerate(logits, start=1):
        lo = max(d - 1, first + d - 2)                   # the anchor (position i + 2 - d) at `first` or later
        lg = lg[:, lo:].float()
        lab = labels[:, lo:]
        losses.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1)))
        hits.append(lg.argmax(-1) == lab)
    return losses, hits


@torch.no_grad()
def chain_acceptance(model: Qwen3MoeModel, seqs: Tensor, prompt_len: int, depth: int, device: torch.device,
                     batch: int = 64) -> dict:
    """On greedy continuations, anchors in the generated part: each depth's top-1 agreement with the target, and
    the mean tokens a window of block depth + 1 would commit (accepted drafts + the target's own token)."""
    model.eval()
    hit_sum = [0.0] * depth
    n = 0
    tpw = 0.0
    for b in range(0, seqs.shape[0], batch):
        w = seqs[b: b + batch].to(device)
        with autocast(device):
            _, hits = chain_losses(model, w, depth, first=prompt_len)
        # depth d's hits start at the row whose anchor is `prompt_len` (chain_losses): column k is anchor
        # prompt_len + k in every depth; the deepest has the fewest full chains
        rows = hits[-1].shape[1]
        ok = torch.stack([h[:, :rows] for h in hits], -1).long()         # [B, anchors, depth]
        for d in range(depth):
            hit_sum[d] += ok[..., d].float().sum().item()
        tpw += (1 + ok.cumprod(-1).sum(-1)).float().sum().item()
        n += ok.shape[0] * ok.shape[1]
    return {"top1_by_depth": [round(h / max(1, n), 4) for h in hit_sum], "tokens_per_window": round(tpw / max(1, n), 4),
            "block": depth + 1, "anchors": n}


def train_chain(model: Qwen3MoeModel, sources: list[tuple[Tensor, int]], depth: int, *, lr: float, seconds: float,
                device: torch.device, log: Log, seed: int, warmup: int = 20) -> dict:
    """Train `mtp.*` (target frozen) on every depth's loss, weighted by DEPTH_WEIGHTS. `sources`: (sequences,
    batch) taken in turn, one a step (short continuations, and long ones so that the head also sees far
    positions)."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    model.to(device).train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = make_optimizer(params, lr, 0.0, device)
    gen = torch.Generator().manual_seed(seed)
    clock = StepClock(100000, seconds)
    step, first, last = 0, None, None
    while step < clock.update(step) and not clock.over():
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, clock.total, warmup, lr)
        seqs, batch = sources[step % len(sources)]
        rows = torch.randint(0, seqs.shape[0], (batch,), generator=gen)
        w = seqs[rows].to(device)
        with autocast(device):
            losses, _ = chain_losses(model, w, depth)
        loss = sum(DEPTH_WEIGHTS[d] * x for d, x in enumerate(losses)) / sum(DEPTH_WEIGHTS[:depth])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        step += 1
        if step == 1 or step % 25 == 0 or step >= clock.total:
            last = [round(x.item(), 4) for x in losses]
            first = first if first is not None else last
            log(stage="mtp_chain", step=step, total=clock.total, s=round(clock.elapsed, 1), ce=last)
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return {"steps": step, "seconds": round(clock.elapsed, 1), "first_ce": first, "last_ce": last}


def merge(head: Path, target: Path) -> None:
    """Write the fine-tuned `mtp.*` tensors into the target's model.safetensors (every other tensor's bytes as they
    were; written under a temporary name, then renamed)."""
    new = load_file(str(head))
    state = load_file(str(target / "model.safetensors"))
    bad = sorted(set(new) - {k for k in state if k.startswith("mtp.")})
    if bad or not new:
        raise SystemExit(f"{head} holds tensors that are not the target's mtp.* ({bad[:3]}); refusing to merge.")
    for k, v in new.items():
        if v.shape != state[k].shape:
            raise SystemExit(f"{k} is {tuple(v.shape)} in {head} but {tuple(state[k].shape)} in the target.")
        state[k] = v
    save_bf16(state, target / "model.safetensors")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fine-tune the MTP head for the runtime's chain (target frozen).")
    ap.add_argument("--pack", type=Path, default=Path("setup_wizard/bundled"))
    ap.add_argument("--target", default="strata-nano")
    ap.add_argument("--data", type=Path, default=Path("training/data"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--merge", type=Path, help="an mtp_head.safetensors to write into the bundled target")
    ap.add_argument("--prompts", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--long-prompts", type=int, default=0, help="continuations of long prompts too (0: none)")
    ap.add_argument("--long-len", type=int, default=1536, help="the long prompts' length")
    ap.add_argument("--long-every", type=int, default=3, help="every n-th step takes long continuations")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=5678)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    if args.merge is not None:
        merge(args.merge, args.pack / args.target)
        return 0
    if args.out is None:
        raise SystemExit("give --out (a folder for the fine-tuned head) or --merge.")
    if not 1 <= args.depth <= len(DEPTH_WEIGHTS):
        raise SystemExit(f"--depth must be 1..{len(DEPTH_WEIGHTS)}.")
    t0 = time.time()
    seed_all(args.seed)
    dev = pick_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "finetune_mtp.jsonl")
    data = corpus.load(args.data)
    model = load_target(args.pack / args.target, device="cpu", dtype=torch.float32).to(dev).eval()
    seqs = make_distill_set(model, data["train"], args.prompts, args.prompt_len, args.new, dev, log,
                            seed=args.seed + 1, batch=1024)
    eval_seqs = make_distill_set(model, data["eval"], max(64, args.prompts // 32), args.prompt_len, args.new, dev,
                                 log, seed=args.seed + 2)
    sources = [(seqs, args.batch)]
    evals = {"short": (eval_seqs, args.prompt_len)}
    if args.long_prompts > 0:
        long_seqs = make_distill_set(model, data["train"], args.long_prompts, args.long_len, args.new, dev, log,
                                     seed=args.seed + 4, batch=256)
        evals["long"] = (make_distill_set(model, data["eval"], 32, args.long_len, args.new, dev, log,
                                          seed=args.seed + 5), args.long_len)
        # about as many tokens a step as a short batch
        long_batch = max(1, args.batch * seqs.shape[1] // long_seqs.shape[1])
        sources = [(seqs, args.batch)] * (args.long_every - 1) + [(long_seqs, long_batch)]
    before = {k: chain_acceptance(model, s, n, args.depth, dev, batch=16) for k, (s, n) in evals.items()}
    log(stage="mtp_chain", before=before)
    st = train_chain(model, sources, args.depth, lr=args.lr, seconds=args.seconds, device=dev, log=log,
                     seed=args.seed + 3)
    st["before"] = before
    st["after"] = {k: chain_acceptance(model, s, n, args.depth, dev, batch=16) for k, (s, n) in evals.items()}
    log(stage="mtp_chain", after=st["after"])
    save_bf16({k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}, args.out / "mtp_head.safetensors")
    st.update(total_s=round(time.time() - t0, 1), sequences=int(seqs.shape[0]), args={k: str(v) for k, v in
                                                                                       vars(args).items()})
    write_json(args.out / "finetune_mtp.json", st)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
