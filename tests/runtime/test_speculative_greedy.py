"""Greedy speculative decoding equals target-only greedy decoding token for token, and rollback leaves no trace."""

import pytest
import torch

import runtime.drafters.head8 as head8_mod
from runtime.drafters.base import Proposal
from runtime.drafters.mtp import MTPDrafter
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.speculative import generate_ids
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10], [2], [40, 41, 3, 3, 3, 12, 60, 61, 2, 9, 9, 17, 33]]
N_NEW = 24


class PoisonedKV(KVCache):
    """Fills every row past the committed length with NaN on rollback: a stale row that is read poisons the output."""

    def rollback(self, length: int) -> None:
        super().rollback(length)
        self.k[:, :, :, length:] = float("nan")
        self.v[:, :, :, length:] = float("nan")


class OracleDrafter:
    """Proposes the target's own greedy continuation (known in advance), wrong at row `bad_row` of each window,
    with confidence 1 / (1 + row) (so spec_min_p truncates at a known row)."""

    kind = "oracle"
    tap_layers = ()

    def __init__(self, prompt, reference, vocab, bad_row=None, max_block=16):
        self.seq = list(prompt) + list(reference)
        self.vocab, self.bad_row, self.max_block = vocab, bad_row, max_block
        self.observed = 0

    def reset(self):
        self.observed = 0

    def observe(self, tokens, hidden, taps, start):
        assert start == self.observed and hidden.shape[0] == tokens.shape[0]
        assert tokens.tolist() == self.seq[start:start + len(tokens)]       # only committed truth is observed
        self.observed = start + len(tokens)

    def propose(self, anchor, pos, n, *, min_p, sampling, generator):
        assert pos == self.observed and anchor == self.seq[pos]
        out, conf = [], []
        for i in range(n):
            c = 1.0 / (1 + i)
            if c < min_p:
                break
            t = self.seq[pos + 1 + i] if pos + 1 + i < len(self.seq) else 0
            if i == self.bad_row:
                t = (t + 1) % self.vocab
            out.append(t)
            conf.append(c)
        return Proposal(torch.tensor(out, dtype=torch.long), None, torch.tensor(conf))


class MTPSteeredByOracle(MTPDrafter):
    """A real MTP drafter (its cache is written, chained and rolled back as usual) whose proposed tokens are
    replaced by an oracle's, so windows accept long runs and the MTP commit path sees every acceptance length."""

    def __init__(self, model, capacity, oracle):
        super().__init__(model, capacity)
        self.oracle = oracle

    def observe(self, tokens, hidden, taps, start):
        super().observe(tokens, hidden, taps, start)
        self.oracle.observe(tokens, hidden, taps, start)

    def reset(self):
        super().reset()
        self.oracle.reset()

    def propose(self, anchor, pos, n, **kw):
        mine = super().propose(anchor, pos, n, **kw)
        theirs = self.oracle.propose(anchor, pos, n, **kw)
        assert mine.tokens.shape == (n,) or kw["min_p"] > 0
        return theirs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_target(make_tiny_target(tmp_path_factory.mktemp("spec"), seed=11, scale=2.0))


def _kv(model, cls=KVCache, cap=128):
    c = model.cfg
    return cls(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap)


@pytest.fixture(scope="module")
def references(model):
    return {tuple(p): generate_ids(model, _kv(model), p, max_new_tokens=N_NEW).token_ids for p in PROMPTS}


def test_reference_is_not_trivial(references):
    for ref in references.values():
        assert len(ref) == N_NEW and len(set(ref)) > 2


@pytest.mark.parametrize("block", [2, 3, 5, 8])
@pytest.mark.parametrize("min_p", [0.0, 0.02, 0.3])
def test_mtp_greedy_equals_target(model, references, block, min_p):
    drafter = MTPDrafter(model, 128)
    for p in PROMPTS:
        res = generate_ids(model, _kv(model, PoisonedKV), p, drafter=drafter, block=block, spec_min_p=min_p,
                           max_new_tokens=N_NEW)
        assert res.token_ids == references[tuple(p)]
        st = res.stats
        assert st["windows"] == len(st["accepted_per_window"]) and sum(st["accepted_per_window"]) == st["accepted"]
        assert st["proposed"] <= st["windows"] * (block - 1)


@pytest.mark.parametrize("block", [2, 4, 7, 16])
@pytest.mark.parametrize("bad_row", [None, 0, 2])
def test_oracle_long_accepted_runs(model, references, block, bad_row):
    for p in PROMPTS:
        ref = references[tuple(p)]
        dr = OracleDrafter(p, ref, model.cfg.vocab_size, bad_row=bad_row)
        res = generate_ids(model, _kv(model, PoisonedKV), p, drafter=dr, block=block, max_new_tokens=N_NEW)
        assert res.token_ids == ref
        apw = res.stats["accepted_per_window"]
        full = block - 1 if bad_row is None or bad_row >= block - 1 else bad_row
        # every window but the last accepts exactly what the oracle got right
        assert all(a == full for a in apw[:-1]), apw
        if bad_row is None:
            assert len(apw) == -(-(N_NEW - 1) // block)


def test_min_p_truncates_and_never_changes_output(model, references):
    p = PROMPTS[0]
    ref = references[tuple(p)]
    dr = OracleDrafter(p, ref, model.cfg.vocab_size)
    res = generate_ids(model, _kv(model), p, drafter=dr, block=8, spec_min_p=0.3, max_new_tokens=N_NEW)
    assert res.token_ids == ref
    assert max(res.stats["accepted_per_window"]) == 3      # confidences 1, 1/2, 1/3 pass; 1/4 stops the window


@pytest.mark.parametrize("block, bad_row", [(3, None), (6, 2), (6, 0), (9, 4), (4, 6)])
def test_rollback_leaves_no_trace(model, references, block, bad_row):
    """Block 1 and block N leave the same target KV (committed rows) and the same MTP cache."""
    p = PROMPTS[2]
    kv1, kvn = _kv(model), _kv(model, PoisonedKV)
    d1 = MTPDrafter(model, 128, chunk=7)
    dn = MTPSteeredByOracle(model, 128, OracleDrafter(p, references[tuple(p)], 64, bad_row=bad_row))
    r1 = generate_ids(model, kv1, p, drafter=OracleDrafter(p, references[tuple(p)], 64), block=1, max_new_tokens=N_NEW)
    rn = generate_ids(model, kvn, p, drafter=dn, block=block, max_new_tokens=N_NEW)
    assert r1.token_ids == rn.token_ids == references[tuple(p)]
    assert rn.stats["accepted"] >= ((N_NEW - 1) // block) * min(block - 1, bad_row if bad_row is not None else 99)
    assert kv1.length == kvn.length == len(p) + N_NEW - 1
    for a, b in zip(kv1.committed(), kvn.committed(), strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # the MTP cache equals one built in a single pass over the committed sequence
    seq = torch.tensor([p + rn.token_ids[:-1]])
    with torch.no_grad():
        h = model(seq).hidden[0]
    d1.observe(seq[0], h, None, 0)
    d1.flush()                                # observed rows wait for the next window's first step
    n = dn.kv.length
    assert n >= d1.kv.length - block          # the last window's entries are added by the next observe
    torch.testing.assert_close(dn.kv.k[:, :, :, :n], d1.kv.k[:, :, :, :n], rtol=0, atol=1e-5)
    torch.testing.assert_close(dn.kv.v[:, :, :, :n], d1.kv.v[:, :, :, :n], rtol=0, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_mtp_first_proposal_matches_teacher_forced_head(model, int8, monkeypatch):
    """The cached MTP step at the anchor equals the training-path MTP prediction (same semantics). On the CPU the
    chain's vocabulary head may be int8 rows with a scale each (runtime/drafters/head8.py): then the logits are the product of
    the bf16-rounded hidden row with the dequantized head, rounded to bf16, and the head's rounding is within
    half a scale step of each weight."""
    monkeypatch.setattr(head8_mod, "CPU_INT8_HEAD", int8)
    # torch's int8 kernel, whatever else this process loaded (the C++ head's own products: tests/runtime/test_cpu_ops.py)
    monkeypatch.setattr(head8_mod, "USE_OP", False)
    seq = torch.tensor([[5, 9, 13, 2, 44, 17, 8]])
    with torch.no_grad():
        out = model(seq)
        tf = model.mtp_logits(seq, out.hidden)[0]       # row p-1 predicts x[p+1]
    dr = MTPDrafter(model, 64)
    assert (dr.head8 is not None) == int8
    n = seq.shape[1] - 1
    dr.observe(seq[0, :n], out.hidden[0, :n], None, 0)
    prop = dr.propose(int(seq[0, n]), n, 1, min_p=0.0, sampling=None, generator=None)
    # the confidence is the step's top-1 probability (with no floor the CPU takes it for the window at once)
    torch.testing.assert_close(prop.confidence, torch.softmax(dr.logits_buf[:1], -1).amax(-1), rtol=0, atol=0)
    if not int8:
        assert prop.tokens.tolist() == [int(tf[n - 1].argmax())]
        torch.testing.assert_close(dr.logits_buf[0], tf[n - 1], rtol=0, atol=1e-5)
        torch.testing.assert_close(prop.confidence, torch.softmax(tf[n - 1:n], -1).amax(-1), rtol=0, atol=1e-6)
        return
    q, scale = dr.head8
    w = model.lm_head.weight.detach()
    assert ((q.float() * scale.float()[:, None] - w).abs() <= scale.float()[:, None] * 0.5 + 1e-6).all()
    dr.reset()
    dr.observe(seq[0, :n], out.hidden[0, :n], None, 0)
    with torch.no_grad():
        dr.flush()
        dr.kv.length = n - 1
        h = dr._step(seq[0, n:n + 1], out.hidden[0, n - 1:n], n)          # the chain's first row, MTP hidden
    ref = h.bfloat16().float() @ (q.float() * scale.float()[:, None]).t()
    torch.testing.assert_close(dr.logits_buf[0], ref[0].bfloat16().float(), rtol=2 ** -7, atol=1e-3)
    assert prop.tokens.tolist() == [int(dr.logits_buf[0].argmax())]
    # and its logits stay near the float head's (a draft's quality, not its bits)
    assert (dr.logits_buf[0] - tf[n - 1]).abs().max() < 0.05 * tf[n - 1].abs().max()


def test_stop_tokens_and_max_new(model, references):
    p = PROMPTS[0]
    ref = references[tuple(p)]
    stop = ref[5]
    k = ref.index(stop)
    dr = OracleDrafter(p, ref, 64)
    res = generate_ids(model, _kv(model), p, drafter=dr, block=8, stop_ids={stop}, max_new_tokens=N_NEW)
    assert res.token_ids == ref[: k + 1] and res.stop_reason == "stop"
    res = generate_ids(model, _kv(model), p, drafter=dr, block=8, max_new_tokens=7)
    assert res.token_ids == ref[:7]
    assert generate_ids(model, _kv(model), p, max_new_tokens=0).token_ids == []


def test_chunked_prefill_changes_nothing(model, references):
    p = PROMPTS[2]
    for chunk in (1, 3, 5):
        res = generate_ids(model, _kv(model), p, drafter=MTPDrafter(model, 128), block=3, prefill_chunk=chunk,
                           max_new_tokens=N_NEW)
        assert res.token_ids == references[tuple(p)]


def test_prompt_observation_is_timed_apart(model, references):
    """The drafter's share of the prompt (each chunk's observation, and the rows the MTP head held back, flushed
    right after the prefill) is `observe_prompt_s`; the windows' drafting `draft_window_s`; `draft_s` both."""
    p = PROMPTS[2]
    dr = MTPDrafter(model, 128)
    at_propose: list[tuple[int, bool]] = []
    propose = dr.propose

    def spy(anchor, pos, n, **kw):
        at_propose.append((dr.kv.length, dr.pending is None))
        return propose(anchor, pos, n, **kw)
    dr.propose = spy
    res = generate_ids(model, _kv(model), p, drafter=dr, block=3, max_new_tokens=N_NEW)
    st = res.stats
    assert res.token_ids == references[tuple(p)]
    # the first window finds the prompt's rows (x[1..], g[..-1]) in the head's cache, none held back
    assert at_propose[0] == (len(p) - 1, True)
    assert st["observe_prompt_s"] > 0 and st["draft_window_s"] > 0
    assert st["draft_s"] == st["observe_prompt_s"] + st["draft_window_s"]


def test_context_full_stops_cleanly(model, references):
    p = PROMPTS[0]
    res = generate_ids(model, _kv(model, cap=10), p, drafter=MTPDrafter(model, 10), block=4, max_new_tokens=N_NEW)
    assert res.stop_reason == "context"
    assert res.token_ids == references[tuple(p)][: 10 - len(p) + 1]


@pytest.mark.parametrize("kwargs, msg", [
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt_ids=[64]), "outside the vocabulary"),
    (dict(prompt_ids=[1] * 200), "does not fit the context"),
    (dict(prompt_ids=[1], block=0), "block"),
    (dict(prompt_ids=[1], spec_min_p=1.5), "spec_min_p"),
    (dict(prompt_ids=[1], max_new_tokens=-1), "max_new_tokens"),
])
def test_bad_input(model, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        generate_ids(model, _kv(model), **kwargs)
