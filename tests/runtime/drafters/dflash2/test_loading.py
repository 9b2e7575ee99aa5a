"""Loading DFlash2 drafters from HF folders and GGUF files; the Drafter protocol; bad files."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.drafters.base import Drafter
from runtime.drafters.dflash2.contract import expected_tensors
from runtime.drafters.dflash2.loading import DFlash2Drafter, load_dflash2_drafter
from runtime.errors import ContractError
from runtime.formats.blocks import dequantize_torch
from runtime.formats.quant_linear import QuantLinear
from runtime.sampling import SamplingParams
from tests.runtime.drafters.dflash2.helpers import (
    drafter_config,
    one_thread,  # noqa: F401  (autouse fixture)
    random_drafter_state,
    tiny_target,
    write_gguf_drafter,
    write_hf_drafter,
)

H, V, CTX = 64, 80, 64


@pytest.fixture(scope="module")
def target():
    return tiny_target(hidden=H, vocab=V, layers=3)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return write_hf_drafter(tmp_path_factory.mktemp("hf") / "drafter", drafter_config(hidden=H, vocab=V))


def run_windows(d: DFlash2Drafter, steps: int = 3, seed: int = 0, sampling=None, min_p: float = 0.0):
    """Observe a prompt, then a few windows with committed rows; return every proposal and drafter logits."""
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(40, d.geom.num_taps * H, generator=g)
    d.reset()
    d.observe(torch.zeros(10, dtype=torch.long), torch.zeros(10, H), taps[:10], 0)
    pos, out = 10, []
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        p = d.propose(5 + i, pos, 7 - i, min_p=min_p, sampling=sampling, generator=gen)
        out.append((p, d.logits_buf[: max(1, 7 - i)].clone()))
        n = 2 + i
        d.observe(torch.zeros(n, dtype=torch.long), torch.zeros(n, H), taps[pos:pos + n], pos)
        pos += n
    return out


def test_hf_drafter_implements_protocol(target, hf_folder):
    d = load_dflash2_drafter(hf_folder, target, context=CTX)
    assert isinstance(d, Drafter) and d.kind == "dflash2" and d.layout == "v2"
    assert d.max_block == 8 and d.tap_layers == (0, 2)
    assert d._shared[0] is target.model.embed_tokens and d._shared[1] is target.lm_head   # shared, not copied
    props = run_windows(d)
    assert [len(p.tokens) for p, _ in props] == [7, 6, 5]
    assert all(p.q is None for p, _ in props)
    p = d.propose(1, d.cache.length, 50)           # n is capped at block - 1
    assert len(p.tokens) == 7
    with pytest.raises(RuntimeError, match="draft at position 3"):
        d.propose(1, 3, 4)
    with pytest.raises(ValueError, match="context gap"):
        d.observe(torch.zeros(1, dtype=torch.long), torch.zeros(1, H), torch.zeros(1, 128), d.cache.length + 2)
    rep = d.memory_report()
    g = d.geom
    assert rep["drafter_kv"] == g.num_layers * 2 * g.num_kv_heads * g.head_dim * 4 * CTX
    assert rep["logits"] == g.block_size * V * 4
    n_params = sum(int(np.prod(s)) for s, _ in expected_tensors(g).values())
    assert rep["drafter_weights"] == n_params * 4       # fp32 on CPU


def test_rejected_rows_leave_no_trace(target, hf_folder):
    """Re-observing from an earlier start replaces the suffix: the same history gives the same proposals."""
    d = load_dflash2_drafter(hf_folder, target, context=CTX)
    taps = torch.randn(20, 128)
    d.observe(torch.zeros(12), torch.zeros(12, H), taps[:12], 0)
    a = d.propose(3, 12, 7)
    d.observe(torch.zeros(12), torch.zeros(12, H), torch.randn(12, 128), 0)   # a different history...
    d.observe(torch.zeros(12), torch.zeros(12, H), taps[:12], 0)             # ...then the true one again
    b = d.propose(3, 12, 7)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.confidence, b.confidence)


def test_gguf_bf16_equals_hf_exactly(target, hf_folder, tmp_path):
    path = write_gguf_drafter(tmp_path / "d.gguf", hf_folder, quant="bf16")
    hf = load_dflash2_drafter(hf_folder, target, context=CTX)
    gg = load_dflash2_drafter(path, target, context=CTX)
    for (k, a), b in zip(hf.model.state_dict().items(), gg.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    for (pa, la), (pb, lb) in zip(run_windows(hf), run_windows(gg), strict=True):
        assert torch.equal(la, lb) and torch.equal(pa.tokens, pb.tokens)
    sp = SamplingParams(temperature=0.8)
    for (pa, _), (pb, _) in zip(run_windows(hf, sampling=sp), run_windows(gg, sampling=sp), strict=True):
        assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.q, pb.q)


@pytest.mark.parametrize("quant", ["q8_0", "q5_0", "q4_0"])
def test_quantized_drafter_matches_dequantized_weights(target, hf_folder, tmp_path, quant):
    path = write_gguf_drafter(tmp_path / f"d-{quant}.gguf", hf_folder, quant=quant)
    q = load_dflash2_drafter(path, target, context=CTX)
    ref = load_dflash2_drafter(hf_folder, target, context=CTX)
    n_quant = 0
    for name, mod in list(q.model.named_modules()):
        if isinstance(mod, QuantLinear):
            n_quant += 1
            assert mod.qtype == quant and mod.blocks.dtype == torch.uint8      # stays quantized in memory
            ref.model.get_submodule(name).weight.data = dequantize_torch(mod.blocks, quant)
    assert n_quant == 1 + 7 * 2
    for (pa, la), (pb, lb) in zip(run_windows(q), run_windows(ref), strict=True):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
        assert torch.equal(pa.tokens, pb.tokens)
    assert q.memory_report()["drafter_weights"] < ref.memory_report()["drafter_weights"]


def test_sampling_and_min_p(target, hf_folder):
    d = load_dflash2_drafter(hf_folder, target, context=CTX)
    for p, _ in run_windows(d, sampling=SamplingParams(temperature=1.0), seed=1):
        assert p.q.shape == (len(p.tokens), V)
        torch.testing.assert_close(p.q.sum(-1), torch.ones(len(p.tokens)))
        assert bool((p.q.gather(-1, p.tokens[:, None]) > 0).all())
        assert int((p.q[0] > 0).sum()) <= d.geom.selector_top_k
    full = run_windows(d)
    for floor in (0.3, 0.6, 0.9):
        cut = run_windows(d, min_p=floor)
        for (pf, _), (pc, _) in zip(full, cut, strict=True):
            low = (pf.confidence < floor).nonzero()
            m = int(low[0, 0]) if len(low) else len(pf.tokens)
            assert pc.tokens.tolist() == pf.tokens[:m].tolist()


def test_v1_layout_runs_as_argmax_drafting(target, tmp_path):
    cfg = drafter_config(hidden=H, vocab=V)
    cfg["architectures"] = ["DFlashDraftModel"]
    folder = write_hf_drafter(tmp_path / "v1", cfg, v1=True)
    d = load_dflash2_drafter(folder, target, context=CTX)
    assert d.layout == "v1" and d.model.candidate_selector is None
    assert all(layer.attention_conv is None for layer in d.model.layers)
    for p, logits in run_windows(d):
        assert p.tokens.tolist() == logits[: len(p.tokens)].argmax(-1).tolist()
    g = write_gguf_drafter(tmp_path / "v1.gguf", folder)
    d2 = load_dflash2_drafter(g, target, context=CTX)
    for (pa, la), (pb, lb) in zip(run_windows(d), run_windows(d2), strict=True):
        assert torch.equal(la, lb) and torch.equal(pa.tokens, pb.tokens)


# ------------------------------------------------------------------------------------------------ bad input

def _variant(tmp_path, hf_folder, *, cfg_patch=None, state_fn=None, name="bad"):
    cfg = json.loads((hf_folder / "config.json").read_text())
    if cfg_patch:
        cfg = cfg_patch(cfg)
    state = load_file(str(hf_folder / "model.safetensors"))
    if state_fn:
        state_fn(state)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _set(state, name, value):
    state[name] = value


def _dc(**kw):
    def patch(cfg):
        cfg["dflash_config"].update(kw)
        return cfg
    return patch


@pytest.mark.parametrize("kw, message", [
    ({"state_fn": lambda s: s.pop("layers.1.mlp.up_proj.weight")},
     "drafter checkpoint is missing tensor 'layers.1.mlp.up_proj.weight'"),
    ({"state_fn": lambda s: _set(s, "lm_head.weight", torch.zeros(V, H, dtype=torch.bfloat16))},
     "unexpected tensor 'lm_head.weight'"),
    ({"state_fn": lambda s: _set(s, "fc.weight", torch.zeros(H, H, dtype=torch.bfloat16))},
     r"'fc.weight' has shape \[64, 64\], expected \[64, 128\]"),
    ({"state_fn": lambda s: _set(s, "norm.weight", s["norm.weight"].float())},
     "'norm.weight' has dtype F32, expected BF16"),
    ({"state_fn": lambda s: s["layers.0.mlp.down_proj.weight"].__setitem__((3, 4), float("nan"))},
     "'layers.0.mlp.down_proj.weight' holds non-finite values"),
    ({"cfg_patch": _dc(mask_token_id=V)}, f"mask_token_id {V} is out of range for vocab_size {V}"),
    ({"cfg_patch": _dc(target_layer_ids=[0, 3])}, r"taps target layers \[3\] but the target has only 3 layers"),
    ({"cfg_patch": lambda c: {**c, "num_target_layers": 48}}, "made for a target with 48 layers"),
])
def test_bad_hf_drafters_give_one_clear_error(target, hf_folder, tmp_path, kw, message):
    folder = _variant(tmp_path, hf_folder, **kw)
    with pytest.raises(ContractError, match=message) as info:
        load_dflash2_drafter(folder, target, context=CTX)
    assert str(info.value).count(".") >= 1 and "\n" not in str(info.value)


def test_target_mismatch(tmp_path):
    folder = write_hf_drafter(tmp_path / "d", drafter_config(hidden=H, vocab=V))
    with pytest.raises(ContractError, match="vocab_size 80 does not match the target's 96"):
        load_dflash2_drafter(folder, tiny_target(hidden=H, vocab=96), context=CTX)
    with pytest.raises(ContractError, match="hidden_size 64 does not match the target's 32"):
        load_dflash2_drafter(folder, tiny_target(hidden=32, vocab=V), context=CTX)


def test_bad_gguf_files(target, hf_folder, tmp_path):
    state = random_drafter_state(json.loads((hf_folder / "config.json").read_text()))
    blocks = gguf.quants.quantize(state["fc.weight"].float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    bad = blocks.copy()
    bad[0, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)   # a NaN block scale
    path = write_gguf_drafter(tmp_path / "nan.gguf", hf_folder, quant="q8_0", tamper={"fc.weight": bad})
    with pytest.raises(ContractError, match="'fc.weight' holds non-finite values"):
        load_dflash2_drafter(path, target, context=CTX)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ContractError, match="is not a readable GGUF file"):
        load_dflash2_drafter(tmp_path / "junk.gguf", target, context=CTX)
    with pytest.raises(ContractError, match="neither a drafter folder"):
        load_dflash2_drafter(tmp_path / "missing.bin", target, context=CTX)


def test_official_shape_ratios_small(tmp_path):
    """The official layout scaled down 16x in width: 5 layers, 5 taps, 32 q heads / 8 kv heads (nh*hd != H),
    I = 3H, K = 2, G = 16, top-k 16, sliding window, softcap; 81 tensors through HF, GGUF BF16 and Q4_0."""
    hidden, vocab = 416, 512
    cfg = drafter_config(hidden=hidden, inter=3 * hidden, layers=5, heads=32, kv_heads=8, head_dim=8, vocab=vocab,
                         taps=(0, 1, 3, 4, 5), num_target_layers=6, block_size=16, rank=32, top_k=16,
                         softcap=20.0, output_multiplier=0.196, is_causal=False, sliding_window=2048,
                         layer_types=["sliding_attention"] * 5)
    target = tiny_target(hidden=hidden, vocab=vocab, layers=6, heads=4, kv_heads=2, head_dim=32, experts=2,
                         moe_inter=32, inter=64)
    folder = write_hf_drafter(tmp_path / "official-small", cfg)
    assert len(load_file(str(folder / "model.safetensors"))) == 81
    hf = load_dflash2_drafter(folder, target, context=48)
    gg = load_dflash2_drafter(write_gguf_drafter(tmp_path / "o.gguf", folder), target, context=48)
    q4 = load_dflash2_drafter(write_gguf_drafter(tmp_path / "o4.gguf", folder, quant="q4_0"), target, context=48)
    assert hf.max_block == 16 and hf.tap_layers == (0, 1, 3, 4, 5)
    assert hf.model.layers[0].attention_conv.kernel_projection.weight.shape == (2 * 2 * hidden // 16, hidden)
    taps = torch.randn(12, 5 * hidden)
    res = []
    for d in (hf, gg, q4):
        d.observe(torch.zeros(12, dtype=torch.long), torch.zeros(12, hidden), taps, 0)
        res.append((d.propose(3, 12, 15), d.logits_buf[:15].clone()))
    assert len(res[0][0].tokens) == 15
    assert torch.equal(res[0][1], res[1][1]) and torch.equal(res[0][0].tokens, res[1][0].tokens)
    assert bool((res[0][1].abs() <= 20.0).all())
    assert not torch.equal(res[0][1], res[2][1])                 # Q4_0 really is another set of weights


@pytest.mark.parametrize("quant", ["bf16", "q4_0"])
def test_files_from_the_real_converter_load_identically(target, hf_folder, tmp_path, quant):
    """`strata-setup convert` output (setup_wizard/convert.py) loads and drafts exactly like the HF folder (BF16)
    or like the test-side GGUF writer (quantized: both must hold gguf-py's bytes)."""
    from setup_wizard.convert import convert_dflash2

    conv = convert_dflash2(hf_folder, quant, tmp_path / f"conv-{quant}.gguf").path
    ref = hf_folder if quant == "bf16" else write_gguf_drafter(tmp_path / "ref.gguf", hf_folder, quant=quant)
    a = load_dflash2_drafter(conv, target, context=CTX)
    b = load_dflash2_drafter(ref, target, context=CTX)
    for (pa, la), (pb, lb) in zip(run_windows(a), run_windows(b), strict=True):
        assert torch.equal(la, lb) and torch.equal(pa.tokens, pb.tokens)


def test_converted_head_keeps_its_target_depth(target, hf_folder, tmp_path):
    """`num_target_layers` survives conversion (an optional GGUF key), so a converted head made for a deeper
    target is refused on load, as its HF folder is."""
    from setup_wizard.convert import convert_dflash2

    folder = _variant(tmp_path, hf_folder, cfg_patch=lambda c: {**c, "num_target_layers": 48})
    conv = convert_dflash2(folder, "q8_0", tmp_path / "deep.gguf").path
    with pytest.raises(ContractError, match="made for a target with 48 layers, this target has 3"):
        load_dflash2_drafter(conv, target, context=CTX)
    right = _variant(tmp_path, hf_folder, cfg_patch=lambda c: {**c, "num_target_layers": 3}, name="right")
    ok = convert_dflash2(right, "q8_0", tmp_path / "ok.gguf").path
    assert load_dflash2_drafter(ok, target, context=CTX).geom.num_target_layers == 3
