"""The KV cache in 8 bits (q8_0, runtime/kv.py): GGUF's Q8_0 bytes, its error bound, its size, and a model that
runs over it (chunked prefill, the fixed-width step, greedy speculative decoding) on the CPU torch path."""

import numpy as np
import pytest
import torch

from runtime.drafters.mtp import MTPDrafter
from runtime.gpu.static_step import StaticStep
from runtime.kv import (
    KV_TIERS,
    KVCache,
    dequantize_q8_0,
    kv_row_bytes,
    one_row_chunk,
    one_row_chunks,
    one_row_layout,
    quantize_q8_0,
    split_chunks,
    split_partials_bytes,
    tiers4,
    uniform_tiers,
)
from runtime.loading import load_target
from runtime.speculative import generate_ids
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def test_quantizer_is_ggufs_q8_0_byte_for_byte():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 128, generator=g) * torch.logspace(-7, 4, 40)[:, None]
    x[0] = 0.0                                  # an all-zero block: scale 0, values 0
    x[1, :32] = torch.tensor([0.5, -0.5, 1.5, -2.5] * 8) * (127 / 2.5)   # exact ties: away from zero
    q, d = quantize_q8_0(x)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (40, 4)
    ours = np.concatenate([d.numpy().view(np.uint8).reshape(40, 4, 2), q.numpy().view(np.uint8).reshape(40, 4, 32)],
                          -1).reshape(40, -1)
    assert np.array_equal(ours, quantize(x.numpy(), GGMLQuantizationType.Q8_0))


def test_round_trip_error_is_half_a_step_per_block():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=g) * 3
    q, d = quantize_q8_0(x)
    back = dequantize_q8_0(q, d, torch.float32)
    step = d.float().repeat_interleave(32, -1)
    # |x - q*d| <= d/2 with the fp32 scale; the float16 rounding of d adds at most 127 * |d - d16|
    amax = x.abs().reshape(3, 7, 2, 32).amax(-1).repeat_interleave(32, -1)
    bound = step / 2 + 127 * (amax / 127 - step).abs() + 1e-6
    assert bool(((x - back).abs() <= bound).all())
    assert float((x - back).abs().max()) < 0.02 * float(x.abs().max())


def test_sizes_and_refusals():
    kv = KVCache(2, 3, 64, 10, quant="q8_0")
    assert kv.k.dtype == torch.int8 and kv.k_scale.shape == (2, 1, 3, 10, 2)
    assert kv.nbytes == 2 * 2 * 3 * 10 * kv_row_bytes(64, 4, "q8_0") == 2 * 2 * 3 * 10 * (64 + 4)
    assert KVCache(2, 3, 64, 10, dtype=torch.bfloat16).nbytes == 2 * 2 * 3 * 10 * 64 * 2
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(2, 3, 16, 10, quant="q8_0")
    with pytest.raises(ValueError, match="unknown KV cache format"):
        KVCache(2, 3, 64, 10, quant="q4_0")
    for ctx in (1, 127, 128, 129, 4096, 4097, 32768, 32769, 40960, 131072):
        assert split_partials_bytes(8, 32, ctx, 128) == 8 * 32 * _chunks_by_walk(ctx, KV_TIERS) * 130 * 4, ctx


def _chunks_by_walk(n: int, tiers: tuple[int, ...]) -> int:
    """Chunks covering positions 0..n-1, walked chunk by chunk: each starts where the last ended and takes the size
    of the tier its start lies in."""
    c0, e0, c1, e1, c2, e2, c3 = tiers4(tiers)
    pos = count = 0
    while pos < n:
        pos += c0 if pos < e0 else c1 if pos < e1 else c2 if pos < e2 else c3
        count += 1
    return count


def test_split_chunks_of_three_and_four_tier_layouts():
    """runtime/kv.py split_chunks (the kernels' `_n_chunks`) against a walk, for three-tier layouts (the third
    tier read as empty), four-tier ones and one chunk size everywhere; anything but 5 or 7 numbers, or tiers that
    do not end on a whole number of their chunks in order, is refused."""
    layouts = [KV_TIERS, (128, 4096, 256, 32768, 1024), (64, 1024, 128, 4096, 256, 32768, 1024),
               (16, 32, 32, 64, 64, 192, 128), (64, 2048, 128, 2048, 256, 8192, 512), uniform_tiers(48)]
    for t in layouts:
        for n in (0, 1, 15, 16, 17, 31, 32, 33, 64, 65, 191, 192, 193, 1000, 1024, 1025, 2048, 4096, 4097, 8193,
                  32768, 32769, 131072):
            assert split_chunks(n, t) == _chunks_by_walk(n, t), (t, n)
    assert tiers4((128, 4096, 256, 32768, 1024)) == (128, 4096, 256, 32768, 1024, 32768, 1024)
    with pytest.raises(ValueError, match="5 or 7 numbers"):
        tiers4((128, 4096, 256))
    with pytest.raises(ValueError, match="whole number of its chunks"):
        tiers4((128, 4000, 256, 32768, 1024))
    with pytest.raises(ValueError, match="follow the one before"):
        tiers4((64, 1024, 128, 512, 256, 32768, 1024))


def test_one_row_chunk_layout(monkeypatch):
    """runtime/kv.py one_row_chunk (the kernels' `_row_chunk`): the least CMIN * 2^k, at most CMAX, with T of them
    covering the row; one_row_chunks the most chunks any length up to a capacity has (against every length); the
    scratch of a one-row split holds every layout's chunks (the tiers, ONE_ROW_CHUNKS, ONE_ROW_CHUNKS_Q8 where set),
    a wider one's the tiers'; a bad layout is refused."""
    for lay in ((64, 32, 2048), (4, 16, 64), (3, 64, 64), (64, 64, 1024)):
        t, cmin, cmax = lay
        most = 0
        for n in range(1, 9000):
            c = one_row_chunk(n, lay)
            assert c % cmin == 0 and (c // cmin) & (c // cmin - 1) == 0 and c <= cmax, (lay, n, c)
            assert (t * c >= n or c == cmax) and (c == cmin or t * (c // 2) < n), (lay, n, c)
            most = max(most, -(-n // c))
            if n in (1, 31, 32, 33, 2048, 2049, 4096, 4097, 8999):
                assert one_row_chunks(n, lay) == most, (lay, n)
    assert [one_row_chunk(n + 1, (64, 32, 2048)) for n in (1024, 2048, 4096, 16384, 131072)] == [32, 64, 128, 512, 2048]
    assert one_row_chunks(40960, (64, 32, 2048)) == 64 and one_row_chunks(131136, (64, 32, 2048)) == 65
    for ctx in (1, 200, 4097, 40960, 131136):
        assert split_partials_bytes(1, 32, ctx, 128) == 32 * max(split_chunks(ctx), one_row_chunks(ctx)) * 130 * 4
        assert split_partials_bytes(8, 32, ctx, 128) == 8 * 32 * split_chunks(ctx) * 130 * 4   # wider: the tiers
    import runtime.kv as kv_mod

    monkeypatch.setattr(kv_mod, "ONE_ROW_CHUNKS_Q8", (256, 64, 1024))     # a q8_0 layout, when set, counts too
    assert split_partials_bytes(1, 32, 40960, 128) == 32 * 256 * 130 * 4 > 32 * split_chunks(40960) * 130 * 4
    with pytest.raises(ValueError, match="power-of-two multiple"):
        one_row_layout((64, 32, 96))
    with pytest.raises(ValueError, match="power-of-two multiple"):
        one_row_layout((0, 32, 64))


def test_layer_write_read_rollback():
    kv = KVCache(1, 2, 32, 12, quant="q8_0")
    layer = kv.layer(0)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 5, 32, generator=g), torch.randn(1, 2, 5, 32, generator=g)
    layer.write(k, v, 3)
    keys, vals = layer.read(8, torch.float32)
    assert keys.shape == (1, 2, 8, 32)
    assert torch.equal(keys[:, :, 3:], dequantize_q8_0(*quantize_q8_0(k), torch.float32))
    assert torch.equal(vals[:, :, 3:], dequantize_q8_0(*quantize_q8_0(v), torch.float32))
    kv.length = 8
    kv.rollback(5)
    ck, _ = kv.committed()
    assert ck.shape == (1, 1, 2, 5, 32) and torch.equal(ck[0, :, :, 3:], keys[:, :, 3:5])
    assert kv.scratch_nbytes == 2 * 2 * 12 * 32 * 4      # one layer's K and V, dequantized


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_target(make_tiny_target(tmp_path_factory.mktemp("q8"), seed=3, scale=2.0, head_dim=32))


def _kv(m, cap=96, quant="q8_0"):
    c = m.cfg
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap, quant=quant)


def test_chunked_prefill_over_q8_equals_one_pass(model):
    ids = torch.randint(0, model.cfg.vocab_size, (1, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        one = model(ids, kv=_kv(model)).logits
        kv = _kv(model)
        parts = torch.cat([model(ids[:, s:s + 8], kv=kv).logits for s in range(0, 23, 8)], 1)
        plain = model(ids).logits
    torch.testing.assert_close(parts, one, atol=1e-4, rtol=0)
    err = float((one - plain).abs().max()) / float(plain.abs().max())
    assert 0 < err < 0.05, err                   # 8 bits are seen, and they are close


def test_step_over_q8_matches_plain_forward(model):
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    kv_a, kv_b = _kv(model, 64), _kv(model, 64)
    with torch.no_grad():
        model(prompt, kv=kv_a)
        model(prompt, kv=kv_b)
        step = StaticStep(model, kv_b, width=4, graph=False)
        for win in ([[12]], [[3, 4, 5]], [[40, 41, 42, 43]]):
            w = torch.tensor(win)
            ref = model(w, kv=kv_a, taps=(0, 2))
            got = step(w, kv_b, (0, 2))
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=0)
            kv_a.rollback(kv_a.length - 1)
            kv_b.rollback(kv_b.length - 1)
        assert torch.equal(kv_a.k[..., :kv_a.length, :], kv_b.k[..., :kv_b.length, :])
        assert torch.equal(kv_a.k_scale[..., :kv_a.length, :], kv_b.k_scale[..., :kv_b.length, :])


def test_greedy_speculative_over_q8_equals_target_only(model):
    prompt = [5, 6, 7, 8, 9, 10, 3]
    kv = _kv(model)
    step = StaticStep(model, kv, width=4, graph=False)
    ref = generate_ids(model, kv, prompt, max_new_tokens=20, step=step)
    for block, min_p in ((2, 0.0), (4, 0.0), (4, 0.3)):
        out = generate_ids(model, kv, prompt, drafter=MTPDrafter(model, 96, max_block=4), block=block,
                           spec_min_p=min_p, max_new_tokens=20, step=step)
        assert out.token_ids == ref.token_ids


def test_engine_takes_q8_0_and_reports_it(tmp_path):
    from runtime.engine import Engine, EngineConfigError

    folder = make_tiny_target(tmp_path, seed=4, head_dim=32)
    eng = Engine.build(folder, "mtp", device="cpu", context=64, kv_dtype="q8_0", prefill_chunk=5)
    assert eng.kv.quant == "q8_0" and eng.drafter.kv.quant is None and eng.drafter.kv.dtype == torch.float32
    assert eng.prefill_chunk == 5
    res = eng.generate([5, 6, 7, 8, 9, 10, 3, 4, 5, 6, 7], max_new_tokens=6, stop_ids=set())
    assert len(res.token_ids) == 6
    rep = eng.memory_report()
    assert rep["target_kv"] == eng.kv.nbytes == 3 * 2 * 2 * 64 * (32 + 2)
    assert rep["scratch"] >= eng.kv.scratch_nbytes > 0
    with pytest.raises(EngineConfigError, match="unknown kv_dtype"):
        Engine.build(folder, "none", device="cpu", context=64, kv_dtype="q4_0")
    with pytest.raises(EngineConfigError, match="multiple of 32"):
        Engine.build(make_tiny_target(tmp_path / "b", head_dim=16), "none", device="cpu", context=64,
                     kv_dtype="q8_0")
    with pytest.raises(EngineConfigError, match="prefill_chunk"):
        Engine.build(folder, "none", device="cpu", context=64, prefill_chunk=0)
