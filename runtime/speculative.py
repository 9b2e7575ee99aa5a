"""The speculative loop (docs/models.md, "Speculative decoding"): draft, verify the window in one target forward, accept, commit.

A window is the last committed token (the anchor, not yet in the target KV) followed by up to block-1 proposals.
Greedy: the longest prefix equal to the target's argmax, then the target's own token (bonus). Sampling: accept x
with probability min(1, p(x)/q(x)); at the first rejection draw from normalise(max(p - q, 0)); if all are
accepted draw the bonus from p. The target KV is rolled back to the committed length after every window.
No drafter (or block 1) is plain decoding through the same code.

One host read per window (docs/models.md, "Speculative loop"): proposals, the floor cut (`Proposal.keep`), the
window and the acceptance stay on the device; the host reads the accepted count and the tokens once, after the
verify forward, in one transfer. Draft and verify times are CUDA events on a GPU (read at the end).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from runtime.drafters.base import Drafter
from runtime.errors import UsageError
from runtime.gpu import prefill_chunk
from runtime.gpu.fallback import fell_back
from runtime.kv import KVCache
from runtime.sampling import (
    RULE_GRAPHS_KEPT,
    SamplingParams,
    gumbel_pick,
    make_generator,
    pick,
    probs,
    sampling_key,
)


@dataclass
class LoopResult:
    token_ids: list[int]
    stats: dict = field(default_factory=dict)
    stop_reason: str = "length"     # length | stop | context | cancelled


# queue the next window's drafting before this window's read where the drafter can (docs/models.md, "Drafting
# ahead"); False: observe and propose after the read, as before (the benchmarks' switch)
DRAFT_AHEAD = True
# target-only windows: queue the next one-row step from this window's device token before reading it (docs/models.md,
# "Decoding ahead"); False: the next step is queued after the read (the benchmarks' switch). On a CPU the step runs
# as it is called, so queuing it earlier gains nothing there and costs a step at a stop token: off unless
# DECODE_AHEAD_CPU (the tests' switch, to run the same code)
DECODE_AHEAD = True
DECODE_AHEAD_CPU = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Draft and verify time per window. On a GPU: CUDA events, read after the last window (reading one earlier
    would be a host sync); on a CPU: the wall clock (work is synchronous there)."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.spans: dict[str, list] = {}
        self.host: dict[str, float] = {}

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, kind: str, t0) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.spans.setdefault(kind, []).append((t0, e))
        else:
            self.host[kind] = self.host.get(kind, 0.0) + time.perf_counter() - t0

    def seconds(self, kind: str) -> float:
        """Total seconds of `kind` (call after a sync)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.spans.get(kind, [])) / 1e3
        return self.host.get(kind, 0.0)


def prefill(model, kv: KVCache, ids: list[int], taps: tuple[int, ...], chunk: int,
            on_chunk: Callable[[Tensor, Tensor, Tensor | None, int], None] | None = None) -> Tensor:
    """Run the prompt through the target in chunks; returns the last row's logits [V]. `on_chunk(tokens,
    hidden, taps, start)` hands each chunk to a drafter as it is made (the whole prompt's rows are never held)."""
    dev = kv.k.device
    last = None
    for s in range(0, len(ids), chunk):
        part = torch.tensor([ids[s:s + chunk]], dtype=torch.long, device=dev)
        is_last = s + chunk >= len(ids)
        out = prefill_chunk.run(model, kv, part, taps, 1 if is_last else -1)   # fused kernels on CUDA
        if on_chunk is not None:
            on_chunk(part[0], out.hidden[0], None if out.taps is None else out.taps[0], s)
        if is_last:
            last = out.logits[0, -1]
    return last


def _as_tokens(draft, device: torch.device) -> Tensor | None:
    if draft is None:
        return None
    if not isinstance(draft, Tensor):
        draft = torch.tensor(list(draft), dtype=torch.long)
    return draft.to(device=device, dtype=torch.long)


class _Read:
    """The window's one host read, in two halves around `ahead`: the values go to pinned host memory behind an event
    (`start`), work queued after them (the next window's drafting, docs/models.md "Drafting ahead") runs while the
    host waits for that event alone (`finish`). Elsewhere (CPU) a plain read."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.cuda = device.type == "cuda"
        self.buf = torch.zeros(n, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.n = 0

    def start(self, vals: Tensor) -> None:
        self.n = int(vals.shape[0])
        if self.n > self.buf.shape[0]:
            self.buf = torch.zeros(self.n, dtype=torch.long, pin_memory=self.cuda)
        self.buf[: self.n].copy_(vals, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def finish(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.buf[: self.n].tolist()


# (accepted count [0-d], the window's next anchor [1]) -> None: queues work after the window, before its read
Ahead = Callable[[Tensor, Tensor], None]


def _read(acc: Tensor, keep: Tensor | None, *rows: Tensor, nxt: Tensor | None = None, ahead: Ahead | None = None,
          reader: _Read | None = None) -> tuple[int, int | None, list[int]]:
    """The window's one host read: the accepted count, the floor's keep count and the token rows, in one transfer;
    `ahead(acc, nxt)` is queued between the copy and the wait (`reader` holds the pinned buffer)."""
    parts = [acc.reshape(1).long()] + ([keep.reshape(1).long()] if keep is not None else []) + [r.long() for r in rows]
    if ahead is None or reader is None:
        vals = torch.cat(parts).tolist()
    else:
        reader.start(torch.cat(parts))
        ahead(acc.reshape(()).long(), nxt)
        vals = reader.finish()
    if keep is None:
        return vals[0], None, vals[1:]
    return vals[0], vals[1], vals[2:]


def _ahead(drafter: Drafter, clock: _Clock, tv, window: Tensor, o, pos: int, n: int, min_p: float,
           sampling: SamplingParams | None, gen: torch.Generator, done: list[bool]) -> Ahead:
    """The next window's drafting, queued before this window's read (docs/models.md, "Drafting ahead"): the drafter
    observes all the window's rows and drafts n rows at pos + acc + 1 from device values; done[0] says whether it
    could. The verify span ends here, the draft span covers what was queued."""
    taps = o.taps[0] if o.taps is not None else None

    def go(acc: Tensor, nxt: Tensor) -> None:
        clock.stop("verify", tv)
        ta = clock.start()
        done[0] = drafter.draft_ahead(window, o.hidden[0], taps, pos, acc, nxt, n, min_p=min_p, sampling=sampling,
                                      generator=gen)
        clock.stop("draft", ta)
    return go


def _step_ahead(step, kv: KVCache, clock: _Clock, tv, box: list) -> Ahead:
    """The next target-only window, queued before this window's read (docs/models.md, "Decoding ahead"): one row,
    the device token `nxt`, at kv.length (this window's end). box[0] gets (its output, its verify span's start)."""

    def go(acc: Tensor, nxt: Tensor) -> None:
        clock.stop("verify", tv)
        t = clock.start()
        box[0] = (step(nxt.reshape(1, 1), kv, ()), t)
    return go


def _accept_greedy_window(logits: Tensor, draft: Tensor | None, keep: Tensor | None = None, ahead: Ahead | None = None,
                          reader: _Read | None = None) -> tuple[int, int, list[int], list[int], Tensor]:
    """Greedy acceptance on the device, one host read: returns (accepted, proposed, new tokens, draft tokens,
    the last new token as a device tensor [1]). Rows at or past `keep` are not proposals."""
    m = 0 if draft is None else int(draft.shape[0])
    if m == 0 and ahead is None:      # target-only: the token alone, one read (a CPU pays per op here)
        # [1], the first of equal maxima (max's index is the cheaper CPU op; argmax elsewhere, as for windows)
        t = logits[:1].max(-1)[1] if logits.device.type == "cpu" else torch.argmax(logits[:1], dim=-1)
        return 0, 0, [int(t)], [], t
    tgt = torch.argmax(logits, dim=-1)                                    # [m+1]
    if m == 0:
        acc = torch.zeros((), dtype=torch.long, device=tgt.device)
        a, _, vals = _read(acc, None, tgt[:1], nxt=tgt[:1], ahead=ahead, reader=reader)
        return 0, 0, vals, [], tgt[:1]
    ok = draft == tgt[:m]
    if keep is not None:
        ok = ok & (torch.arange(m, device=tgt.device) < keep)
    acc = torch.cumprod(ok.to(torch.int32), 0).sum()
    # the target's token after the accepted ones, on the device: before the read only when drafting ahead needs it
    nxt = tgt.index_select(0, acc.reshape(1).long()) if ahead is not None else None
    a, k, vals = _read(acc, keep, tgt, draft, nxt=nxt, ahead=ahead, reader=reader)
    return a, (m if k is None else k), vals[:a + 1], vals[m + 1:], nxt if nxt is not None else tgt[a:a + 1]


def _uniforms(n: int, gen: torch.Generator, device: torch.device, out: Tensor | None = None) -> Tensor:
    """n draws of U[0, 1) (0 included: float32 rand can return exactly 0), into `out` when given (the same values
    either way)."""
    if out is not None:
        return torch.rand(n, generator=gen, device=device, out=out)
    return torch.rand(n, generator=gen, device=device)


def _sampled_rule(logits: Tensor, draft: Tensor | None, q: Tensor | None, keep: Tensor | None, noise: Tensor,
                  sp: SamplingParams) -> tuple[Tensor, Tensor]:
    """(accepted count, the window's new token [1]) of rejection sampling from uniforms drawn beforehand: noise[:m]
    test the m proposals, noise[m:] (one per vocabulary entry) draw the token by Gumbel-max (`gumbel_pick`: exactly
    a draw from its row). Device ops on fixed shapes only, so a CUDA graph can hold them (`_SampledRule`)."""
    p = probs(logits, sp)                                                 # [m+1, V]
    m = 0 if draft is None else int(draft.shape[0])
    if m:
        dev = p.device
        idx = torch.arange(m, device=dev)
        d = draft.clamp(0, p.shape[-1] - 1)             # an id outside the vocabulary is refused after the read
        px, qx = p[idx, d], q[idx, d]
        # u < p/q without dividing; strict, so a token the target cannot emit (p = 0) is never accepted, not
        # even when u draws exactly 0 (once in 2^24 draws in float32)
        ok = noise[:m] * qx < px
        if keep is not None:
            ok = ok & (idx < keep)
        acc = torch.cumprod(ok.to(torch.int32), 0).sum()
        rejected = acc < (keep if keep is not None else m)
        at = acc.reshape(1).long()
        pr = p.index_select(0, at)[0]
        qr = torch.cat((q, torch.zeros_like(q[:1]))).index_select(0, at)[0]
        resid = torch.clamp(pr - qr * rejected, min=0.0)
        s = resid.sum()
        row = torch.where(rejected & (s > 0), resid / s.clamp_min(torch.finfo(resid.dtype).tiny), pr)
    else:
        acc = torch.zeros((), dtype=torch.long, device=p.device)
        row = p[0]
    return acc, gumbel_pick(torch.log(row), noise[m:]).reshape(1)


# sampled windows: the acceptance rule replayed from CUDA graphs (`_SampledRule`); False: the same ops run eagerly,
# one launch each (the benchmarks' switch). At most runtime.sampling.RULE_GRAPHS_KEPT graphs are kept
SAMPLED_GRAPHS = True


class _Rule:
    """One captured rule: its static inputs and outputs."""

    def __init__(self, logits: Tensor, draft: Tensor | None, q: Tensor | None, keep: Tensor | None,
                 sp: SamplingParams) -> None:
        m = 0 if draft is None else int(draft.shape[0])
        self.logits = logits.detach().clone()
        self.draft = draft.detach().clone() if m else None
        self.q = q.detach().clone() if m else None
        self.keep = keep.detach().reshape(()).clone() if keep is not None else None
        self.noise = torch.full((m + logits.shape[-1],), 0.5, dtype=torch.float32, device=logits.device)
        from runtime.gpu.capture import capture

        self.graph, (self.acc, self.tok) = capture(
            lambda: _sampled_rule(self.logits, self.draft, self.q, self.keep, self.noise, sp))


class _SampledRule:
    """`_sampled_rule` for one device: on a GPU from CUDA graphs keyed by the window's shape, its floor and the
    sampling parameters, so a sampled window's acceptance is a few copies, one fill of uniforms and one replay
    instead of some 30 launches (docs/models.md, "Sampled acceptance"); eagerly on a CPU, and for good once a
    capture fails. The uniforms are the same draws either way (one fill of m + V from the run's generator), so the
    two paths give the same tokens."""

    def __init__(self, device: torch.device) -> None:
        self.graphs: dict[tuple, _Rule] = {}
        self.enabled = device.type == "cuda"
        self.errors: list[str] = []

    def __call__(self, logits: Tensor, draft: Tensor | None, q: Tensor | None, keep: Tensor | None,
                 sp: SamplingParams, gen: torch.Generator, graph: bool = True) -> tuple[Tensor, Tensor]:
        """`graph` False: this window's shape is not worth a graph (the loop captures only target-only windows and
        full blocks; the shorter windows at a generation's end would each be a graph of their own)."""
        m = 0 if draft is None else int(draft.shape[0])
        n = m + int(logits.shape[-1])
        if m:
            if q is None or q.shape[0] != m:
                raise RuntimeError("the drafter returned no draft distribution q for a sampled proposal.")
            q = q.to(logits.device, torch.float32)
        rule = self._rule(logits, draft, q, keep, sp) if graph and self.enabled and SAMPLED_GRAPHS else None
        if rule is None:
            return _sampled_rule(logits, draft, q, keep, _uniforms(n, gen, logits.device), sp)
        rule.logits.copy_(logits)
        if m:
            rule.draft.copy_(draft)
            rule.q.copy_(q)
        if keep is not None:
            rule.keep.copy_(keep.reshape(()))
        _uniforms(n, gen, logits.device, out=rule.noise)
        rule.graph.replay()
        # the token outlives the window (the next window's anchor): a copy, not the graph's buffer
        return rule.acc, rule.tok.clone()

    def _rule(self, logits: Tensor, draft: Tensor | None, q: Tensor | None, keep: Tensor | None,
              sp: SamplingParams) -> _Rule | None:
        key = (tuple(logits.shape), logits.dtype, None if draft is None else int(draft.shape[0]),
               None if keep is None else keep.dtype, sampling_key(sp))
        rule = self.graphs.pop(key, None)
        if rule is None:
            try:
                rule = _Rule(logits, draft, q, keep, sp)
            except Exception as e:  # a capture that fails: the eager ops from now on
                fell_back(self.errors, e, "the sampled acceptance rule's CUDA graph", "its eager ops")
                self.enabled = False
                self.graphs.clear()
                return None
            while len(self.graphs) >= RULE_GRAPHS_KEPT:
                self.graphs.pop(next(iter(self.graphs)))
        self.graphs[key] = rule              # most recently used last
        return rule


_RULES: dict[str, _SampledRule] = {}


def sampled_rule(device: torch.device) -> _SampledRule:
    """The device's sampled acceptance (its graphs are kept between generations)."""
    key = str(device)
    if key not in _RULES:
        _RULES[key] = _SampledRule(device)
    return _RULES[key]


def _accept_sampled_window(logits: Tensor, draft: Tensor | None, q: Tensor | None, sp: SamplingParams,
                           gen: torch.Generator, keep: Tensor | None = None, ahead: Ahead | None = None,
                           reader: _Read | None = None, block: int | None = None
                           ) -> tuple[int, int, list[int], list[int], Tensor]:
    """Rejection sampling on the device (`_sampled_rule`: m + V uniforms, the m proposals' tests, then one token
    from the residual of the first rejected row, or from p of the row after the last proposal), one host read.
    From a graph when the window is target-only or a full `block` (None: any window)."""
    m = 0 if draft is None else int(draft.shape[0])
    acc, tok = sampled_rule(logits.device)(logits, draft, q, keep, sp, gen,
                                           graph=block is None or m in (0, block - 1))
    rows = (draft, tok) if m else (tok,)
    a, k, vals = _read(acc, keep, *rows, nxt=tok, ahead=ahead, reader=reader)
    return a, (m if k is None else k), vals[:a] + [vals[-1]], vals[:m], tok


def _accept_greedy(logits: Tensor, draft, keep: Tensor | None = None) -> tuple[int, list[int]]:
    """(accepted, committed tokens) for a greedy window: the longest prefix equal to the target's argmax, then the
    target's own token."""
    a, _, new, _, _ = _accept_greedy_window(logits, _as_tokens(draft, logits.device), keep)
    return a, new


def _accept_sampled(logits: Tensor, draft, q: Tensor | None, sp: SamplingParams, gen: torch.Generator,
                    keep: Tensor | None = None) -> tuple[int, list[int]]:
    """(accepted, committed tokens) for a sampled window: accept x with probability min(1, p(x)/q(x)); at the first
    rejection draw from normalise(max(p - q, 0)); if all are accepted draw the bonus from p."""
    d = _as_tokens(draft, logits.device)
    a, _, new, _, _ = _accept_sampled_window(logits, d if d is not None and d.numel() else None, q, sp, gen, keep)
    return a, new


# the largest draft temperature scale a run takes (`generate_ids`): hotter drafts are rarely accepted
MAX_DRAFT_TEMP_SCALE = 4.0


def generate_ids(model, kv: KVCache, prompt_ids: list[int], *, drafter: Drafter | None = None,
                 max_new_tokens: int = 128, sampling: SamplingParams | None = None, block: int = 1,
                 spec_min_p: float = 0.0, stop_ids: set[int] | frozenset[int] = frozenset(),
                 prefill_chunk: int = 512, on_tokens: Callable[[list[int]], None] | None = None,
                 logits_buf: Tensor | None = None, step=None,
                 should_stop: Callable[[], bool] | None = None, draft_temp_scale: float = 1.0) -> LoopResult:
    """Generate after `prompt_ids`; the output equals target-only decoding (exactly for greedy, in
    distribution for sampling) whatever the drafter proposes.

    `step` (optional, e.g. `runtime.gpu.static_step.StaticStep`): runs every decode/verify window instead of
    `model(window, kv=kv, taps=taps)`, with the same contract (appends at kv.length, returns a TargetOutput).
    `should_stop()` is asked before every window; True ends the generation there (stop_reason "cancelled"), so a
    caller on another thread (a server whose client left) stops the work within one window.
    `draft_temp_scale`: when sampling, the drafter draws at the request's temperature times this (its proposals'
    `q` is what they were drawn from, so the output's distribution is the target's whatever the scale; a drafter
    more confident than its target is accepted more often drawn hotter: docs/models.md, "Draft temperature")."""
    sp = sampling or SamplingParams()
    if not prompt_ids:
        raise UsageError("the prompt is empty; give at least one token.")
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if block < 1:
        raise UsageError(f"block must be >= 1, got {block}.")
    if not 0 <= spec_min_p <= 1:
        raise UsageError(f"spec_min_p must be in [0, 1], got {spec_min_p}.")
    if not 0 < draft_temp_scale <= MAX_DRAFT_TEMP_SCALE:
        raise UsageError(f"draft_temp_scale must be in (0, {MAX_DRAFT_TEMP_SCALE}], got {draft_temp_scale}.")
    # what the drafter samples with (None: greedy drafts for greedy decoding)
    dsp = None if sp.greedy else sp if draft_temp_scale == 1 else replace(
        sp, temperature=sp.temperature * draft_temp_scale)
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
             "accepted_per_window": [], "draft_s": 0.0, "draft_window_s": 0.0, "observe_prompt_s": 0.0,
             "verify_s": 0.0, "prefill_s": 0.0, "drafted_ahead": 0, "decoded_ahead": 0, "decode_s": 0.0,
             "decode_tok_s": 0.0, "block": block if use_draft else 1, "spec_min_p": spec_min_p,
             "draft_temp_scale": draft_temp_scale if use_draft and not sp.greedy else None}
    res = LoopResult(token_ids=[], stats=stats)
    if max_new_tokens == 0:
        return res

    with torch.no_grad():
        kv.reset()
        clock = _Clock(dev)
        t0 = time.perf_counter()

        def observe_chunk(tokens: Tensor, hidden: Tensor, tap_rows: Tensor | None, start: int) -> None:
            ta = clock.start()
            drafter.observe(tokens, hidden, tap_rows, start)
            clock.stop("observe_prompt", ta)

        if use_draft:
            drafter.reset()
        last = prefill(model, kv, prompt_ids, taps, prefill_chunk, on_chunk=observe_chunk if use_draft else None)
        if use_draft and hasattr(drafter, "flush"):
            # rows a drafter held back for its next window (the MTP head's share of the prompt's last chunk) are
            # prompt work: done and timed with the rest of the prompt's observation, not in the first window
            ta = clock.start()
            drafter.flush()
            clock.stop("observe_prompt", ta)
        first = pick(last, sp, gen)
        _sync(dev)
        t1 = time.perf_counter()
        obs_s = clock.seconds("observe_prompt")
        stats["prefill_s"] = max(0.0, t1 - t0 - obs_s)
        out = [first]
        if on_tokens:
            on_tokens([first])
        anchor, pos = first, n_prompt
        # the anchor also lives on the device: each window's last token is taken from the device result, so a window
        # is assembled there (anchor + proposals) and the host reads once per window, in the acceptance
        anchor_dev = torch.tensor([first], dtype=torch.long, device=dev)
        # drafting ahead needs a drafter that can (graphs attached: on a GPU; on the CPU, where the graphs' functions
        # run eagerly, the tests attach them to run the same code)
        reader = (_Read(dev, 2 * block + 4) if use_draft and DRAFT_AHEAD and hasattr(drafter, "draft_ahead")
                  and getattr(drafter, "graphs", None) is not None else None)
        # target-only windows through a fixed-width step: the next one is queued before this one's read
        decode_ahead = (not use_draft and DECODE_AHEAD and (dev.type == "cuda" or DECODE_AHEAD_CPU)
                        and step is not None and step.accepts(1, ()))
        if decode_ahead:
            reader = _Read(dev, 4)
        pending: list = [None]      # (output, verify span start) of a window queued ahead, at kv.length - 1
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
            draft = q = keep = None
            if k > 0:
                ta = clock.start()
                prop = drafter.propose(anchor, pos, k, min_p=spec_min_p, sampling=dsp, generator=gen)
                draft = _as_tokens(prop.tokens[:k], dev)
                q = prop.q[: draft.shape[0]] if prop.q is not None else None
                keep = prop.keep
                if draft.shape[0] == 0:
                    draft = None
                clock.stop("draft", ta)
            # ids outside the vocabulary are clamped for the forward and refused after the window's one read
            window = (anchor_dev if draft is None else torch.cat((anchor_dev, draft.clamp(0, V - 1))))[None]
            if pending[0] is not None:      # queued before the last window's read, from its device token
                (o, tv), pending[0] = pending[0], None
            else:
                tv = clock.start()
                if step is not None and step.accepts(window.shape[1], taps):
                    o = step(window, kv, taps)
                else:
                    o = model(window, kv=kv, taps=taps)
            logits = o.logits[0]
            if logits_buf is not None and logits.shape[0] <= logits_buf.shape[0]:
                logits_buf[: logits.shape[0]].copy_(logits)
                logits = logits_buf[: logits.shape[0]]
            ahead_fn, ahead_on = None, [False]
            W = window.shape[1]
            # only when the next window is sure to be a full block, whatever this one accepts (a DFlash2 block's
            # rows depend on its width)
            if decode_ahead:
                # only when a next window is sure to run unless this token stops (a stop token or a cancel
                # discards it: one step's work)
                if remaining >= 2 and pos + 2 <= kv.capacity:
                    ahead_fn = _step_ahead(step, kv, clock, tv, pending)
            elif reader is not None and remaining >= W + block and pos + W + block <= kv.capacity:
                ahead_fn = _ahead(drafter, clock, tv, window[0], o, pos, block - 1, spec_min_p, dsp, gen, ahead_on)
            if sp.greedy:
                acc, proposed, new, drafted, anchor_dev = _accept_greedy_window(logits, draft, keep, ahead_fn, reader)
            else:
                acc, proposed, new, drafted, anchor_dev = _accept_sampled_window(logits, draft, q, sp, gen, keep,
                                                                                 ahead_fn, reader, block)
            bad = [t for t in drafted[:proposed] if not 0 <= t < V]
            if bad:
                raise RuntimeError(f"the drafter proposed token id {bad[0]}, outside the vocabulary ({V}).")
            if pending[0] is None:          # else the window queued ahead holds kv.length = pos + 2
                kv.rollback(pos + acc + 1)
            else:
                stats["decoded_ahead"] += 1
            if ahead_fn is None:
                clock.stop("verify", tv)
            for j, t in enumerate(new):
                if t in stop_ids:
                    new = new[: j + 1]
                    res.stop_reason = "stop"
                    break
            new = new[:remaining]
            # accepted proposals that are emitted (none past a stop token): accepted <= generated_tokens - 1
            emitted = min(acc, len(new))
            stats["windows"] += 1
            stats["proposed"] += proposed
            stats["accepted"] += emitted
            stats["accepted_per_window"].append(emitted)   # one entry per window, target-only windows too
            out.extend(new)
            if on_tokens:
                on_tokens(new)
            if res.stop_reason == "stop" or len(out) >= max_new_tokens:
                break
            if ahead_on[0]:
                stats["drafted_ahead"] += 1
                drafter.settle(acc)                # the rows were observed ahead: the host's bookkeeping only
            elif use_draft:
                ta = clock.start()
                taps_rows = o.taps[0, : acc + 1] if o.taps is not None else None
                drafter.observe(window[0, : acc + 1], o.hidden[0, : acc + 1], taps_rows, pos)
                clock.stop("draft", ta)
            anchor, pos = new[-1], pos + acc + 1
        if pending[0] is not None:          # a window queued ahead of a stop or a cancel: not committed
            kv.rollback(kv.length - 1)
        _sync(dev)
        t2 = time.perf_counter()
    res.token_ids = out
    stats["generated_tokens"] = len(out)
    # draft_s: all the drafter's time; observe_prompt_s: its share of the prompt (once a prompt); draft_window_s:
    # its time in the windows (what a window costs, prompt length aside)
    stats["draft_window_s"] = clock.seconds("draft")
    stats["observe_prompt_s"] = obs_s
    stats["draft_s"] = obs_s + stats["draft_window_s"]
    stats["verify_s"] = clock.seconds("verify")
    stats["decode_s"] = t2 - t1
    # tokens made by decode windows (the first token comes from prefill) per second of decode
    stats["decode_tok_s"] = ((len(out) - 1) / stats["decode_s"]) if stats["decode_s"] > 0 else 0.0
    return res
