"""The speculative loop (docs/models.md, "Speculative decoding"): draft, verify the window in one target forward, accept, commit.

A window is the last committed token (the anchor, not yet in the target KV) followed by up to block-1 proposals.
Greedy: the longest prefix equal to the target's argmax, then the target's own token (bonus). Sampling: accept x
with probability min(1, p(x)/q(x)); at the first rejection draw from normalise(max(p - q, 0)); if all are
accepted draw the bonus from p. The target KV is rolled back to the committed length after every window.
No drafter (or block 1) is plain decoding through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from runtime.drafters.base import Drafter
from runtime.errors import UsageError
from runtime.kv import KVCache
from runtime.sampling import SamplingParams, draw, make_generator, pick, probs


@dataclass
class LoopResult:
    token_ids: list[int]
    stats: dict = field(default_factory=dict)
    stop_reason: str = "length"     # length | stop | context | cancelled


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model, kv: KVCache, ids: list[int], taps: tuple[int, ...], chunk: int,
            on_chunk: Callable[[Tensor, Tensor, Tensor | None, int], None] | None = None) -> Tensor:
    """Run the prompt through the target in chunks; returns the last row's logits [V]. `on_chunk(tokens,
    hidden, taps, start)` hands each chunk to a drafter as it is made (the whole prompt's rows are never held)."""
    dev = kv.k.device
    last = None
    for s in range(0, len(ids), chunk):
        part = torch.tensor([ids[s:s + chunk]], dtype=torch.long, device=dev)
        is_last = s + chunk >= len(ids)
        out = model(part, kv=kv, taps=taps, logits_to_keep=1 if is_last else -1)
        if on_chunk is not None:
            on_chunk(part[0], out.hidden[0], None if out.taps is None else out.taps[0], s)
        if is_last:
            last = out.logits[0, -1]
    return last


def _accept_greedy(logits: Tensor, draft: list[int]) -> tuple[int, list[int]]:
    tgt = torch.argmax(logits, dim=-1).tolist()
    acc = 0
    while acc < len(draft) and draft[acc] == tgt[acc]:
        acc += 1
    return acc, draft[:acc] + [tgt[acc]]


def _uniforms(m: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """m draws of U[0, 1) for the acceptance test (0 included: float32 rand can return exactly 0)."""
    return torch.rand(m, generator=gen, device=device)


def _accept_sampled(logits: Tensor, draft: list[int], q: Tensor | None, sp: SamplingParams,
                    gen: torch.Generator) -> tuple[int, list[int]]:
    p = probs(logits, sp)                       # [m+1, V]
    m = len(draft)
    if m:
        if q is None or q.shape[0] != m:
            raise RuntimeError("the drafter returned no draft distribution q for a sampled proposal.")
        q = q.to(p.device, torch.float32)
        idx = torch.arange(m, device=p.device)
        d = torch.tensor(draft, device=p.device)
        px, qx = p[idx, d], q[idx, d]
        u = _uniforms(m, gen, p.device)
        # u < p/q without dividing; strict, so a token the target cannot emit (p = 0) is never accepted, not
        # even when u draws exactly 0 (once in 2^24 draws in float32)
        ok = (u * qx < px).tolist()
        for i in range(m):
            if not ok[i]:
                resid = torch.clamp(p[i] - q[i], min=0.0)
                s = float(resid.sum())
                row = resid / s if s > 0 else p[i]
                return i, draft[:i] + [draw(row, gen)]
    return m, draft + [draw(p[m], gen)]


def generate_ids(model, kv: KVCache, prompt_ids: list[int], *, drafter: Drafter | None = None,
                 max_new_tokens: int = 128, sampling: SamplingParams | None = None, block: int = 1,
                 spec_min_p: float = 0.0, stop_ids: set[int] | frozenset[int] = frozenset(),
                 prefill_chunk: int = 512, on_tokens: Callable[[list[int]], None] | None = None,
                 logits_buf: Tensor | None = None, step=None,
                 should_stop: Callable[[], bool] | None = None) -> LoopResult:
    """Generate after `prompt_ids`; the output equals target-only decoding (exactly for greedy, in
    distribution for sampling) whatever the drafter proposes.

    `step` (optional, e.g. `runtime.gpu.static_step.StaticStep`): runs every decode/verify window instead of
    `model(window, kv=kv, taps=taps)`, with the same contract (appends at kv.length, returns a TargetOutput).
    `should_stop()` is asked before every window; True ends the generation there (stop_reason "cancelled"), so a
    caller on another thread (a server whose client left) stops the work within one window."""
    sp = sampling or SamplingParams()
    if not prompt_ids:
        raise UsageError("the prompt is empty; give at least one token.")
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if block < 1:
        raise UsageError(f"block must be >= 1, got {block}.")
    if not 0 <= spec_min_p <= 1:
        raise UsageError(f"spec_min_p must be in [0, 1], got {spec_min_p}.")
    V = model.cfg.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < V]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary (size {V}).")
    n_prompt = len(prompt_ids)
    if n_prompt + 1 > kv.capacity:
        raise UsageError(f"the prompt has {n_prompt} tokens and does not fit the context of {kv.capacity}; "
                         f"shorten it.")      # the engine adds whether the context can grow (Engine.check_room)
    dev = kv.k.device
    if drafter is not None and block > 1:
        block = min(block, drafter.max_block)
    use_draft = drafter is not None and block > 1
    taps = tuple(drafter.tap_layers) if use_draft else ()
    gen = make_generator(sp.seed, dev)
    stats = {"prompt_tokens": n_prompt, "generated_tokens": 0, "windows": 0, "proposed": 0, "accepted": 0,
             "accepted_per_window": [], "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0,
             "decode_tok_s": 0.0, "block": block if use_draft else 1, "spec_min_p": spec_min_p}
    res = LoopResult(token_ids=[], stats=stats)
    if max_new_tokens == 0:
        return res

    with torch.no_grad():
        kv.reset()
        t0 = time.perf_counter()
        obs_s = [0.0]

        def observe_chunk(tokens: Tensor, hidden: Tensor, tap_rows: Tensor | None, start: int) -> None:
            ta = time.perf_counter()
            drafter.observe(tokens, hidden, tap_rows, start)
            obs_s[0] += time.perf_counter() - ta

        if use_draft:
            drafter.reset()
        last = prefill(model, kv, prompt_ids, taps, prefill_chunk, on_chunk=observe_chunk if use_draft else None)
        first = pick(last, sp, gen)
        _sync(dev)
        t1 = time.perf_counter()
        stats["prefill_s"] = t1 - t0 - obs_s[0]
        stats["draft_s"] += obs_s[0]
        out = [first]
        if on_tokens:
            on_tokens([first])
        anchor, pos = first, n_prompt
        if first in stop_ids:
            res.stop_reason = "stop"
        while res.stop_reason != "stop" and len(out) < max_new_tokens:
            if should_stop is not None and should_stop():
                res.stop_reason = "cancelled"
                break
            if pos + 1 > kv.capacity:
                res.stop_reason = "context"
                break
            remaining = max_new_tokens - len(out)
            k = min(block - 1, remaining - 1, kv.capacity - pos - 1) if use_draft else 0
            draft: list[int] = []
            q = None
            if k > 0:
                ta = time.perf_counter()
                prop = drafter.propose(anchor, pos, k, min_p=spec_min_p, sampling=None if sp.greedy else sp,
                                       generator=gen)
                draft = [int(t) for t in prop.tokens.tolist()][:k]
                q = prop.q[: len(draft)] if prop.q is not None else None
                bad = [t for t in draft if not 0 <= t < V]
                if bad:
                    raise RuntimeError(f"the drafter proposed token id {bad[0]}, outside the vocabulary ({V}).")
                stats["draft_s"] += time.perf_counter() - ta
            tv = time.perf_counter()
            window = torch.tensor([[anchor] + draft], dtype=torch.long, device=dev)
            if step is not None and step.accepts(window.shape[1], taps):
                o = step(window, kv, taps)
            else:
                o = model(window, kv=kv, taps=taps)
            logits = o.logits[0]
            if logits_buf is not None and logits.shape[0] <= logits_buf.shape[0]:
                logits_buf[: logits.shape[0]].copy_(logits)
                logits = logits_buf[: logits.shape[0]]
            if sp.greedy:
                acc, new = _accept_greedy(logits, draft)
            else:
                acc, new = _accept_sampled(logits, draft, q, sp, gen)
            kv.rollback(pos + acc + 1)
            stats["verify_s"] += time.perf_counter() - tv
            for j, t in enumerate(new):
                if t in stop_ids:
                    new = new[: j + 1]
                    res.stop_reason = "stop"
                    break
            new = new[:remaining]
            # accepted proposals that are emitted (none past a stop token): accepted <= generated_tokens - 1
            emitted = min(acc, len(new))
            stats["windows"] += 1
            stats["proposed"] += len(draft)
            stats["accepted"] += emitted
            stats["accepted_per_window"].append(emitted)   # one entry per window, target-only windows too
            out.extend(new)
            if on_tokens:
                on_tokens(new)
            if res.stop_reason == "stop" or len(out) >= max_new_tokens:
                break
            if use_draft:
                ta = time.perf_counter()
                taps_rows = o.taps[0, : acc + 1] if o.taps is not None else None
                drafter.observe(window[0, : acc + 1], o.hidden[0, : acc + 1], taps_rows, pos)
                stats["draft_s"] += time.perf_counter() - ta
            anchor, pos = new[-1], pos + acc + 1
        _sync(dev)
        t2 = time.perf_counter()
    res.token_ids = out
    stats["generated_tokens"] = len(out)
    stats["decode_s"] = t2 - t1
    # tokens made by decode windows (the first token comes from prefill) per second of decode
    stats["decode_tok_s"] = ((len(out) - 1) / stats["decode_s"]) if stats["decode_s"] > 0 else 0.0
    return res
