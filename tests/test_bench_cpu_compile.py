"""bench/cpu_compile.py's plain-ops step (what it compiles) is the bundled pack's model: run eagerly, its logits
match the shipped CPU step's at one row and at a window of rows, it writes the window's K/V where the shipped
step does, and a row's bits do not depend on the rows after it."""

import torch

from bench.common import NANO, task_prompts
from bench.cpu_compile import float_caches, plain_step, weights


def _prefilled(n_tokens: int):
    """The pack's engine with the first n_tokens of the code prompt prefilled: (engine, ids, start, weights)."""
    from runtime.engine import Engine

    eng = Engine.build(NANO, "none", device="cpu", context=1024)
    ids = eng.tokenizer.encode(task_prompts()["code"]).ids[:n_tokens]
    eng.generate(ids, draft=False, max_new_tokens=1, stop_ids=set(), width=1)
    return eng, ids, eng.kv.length, weights(eng.model)


def test_plain_step_is_the_shipped_step():
    from runtime.gpu import static_step as ss

    with torch.no_grad():
        eng, ids, start, P = _prefilled(120)
        kv = eng.kv
        n = len(P["layers"])
        for width in (1, 3):
            kcs, vcs = float_caches(kv, n)
            window = torch.tensor([ids[-width:]])
            kv.length = start
            ref = ss.StaticStep(eng.model, kv, width, graph=False)(window, kv).logits[0].float()
            got = plain_step(P, window[0], start, kcs, vcs)
            assert got.shape == ref.shape
            assert (got - ref).abs().max() < 1e-4 * ref.abs().max()
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
            k_ref = kv.layer(n - 1).kernel_args()[0][:, start:start + width].float()
            assert torch.allclose(kcs[-1][:, start:start + width], k_ref, atol=1e-5)


def test_plain_step_row_keeps_its_bits_when_later_rows_change():
    # what bench/cpu_compile.py checks for every form (the compiled one too): at a fixed width, the first row of a
    # window does not depend on the rows after it
    with torch.no_grad():
        eng, ids, start, P = _prefilled(80)
        win = torch.tensor(ids[-4:])
        other = win.clone()
        other[1:] = (other[1:] + 7) % P["emb"].shape[0]
        a = plain_step(P, win, start, *float_caches(eng.kv, len(P["layers"])))
        b = plain_step(P, other, start, *float_caches(eng.kv, len(P["layers"])))
        assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
