"""runtime/loading_gguf.py and Engine.build on a .gguf target: files of Strata's converter and of gguf-py's own
writer in llama.cpp's layout load to the same model; BF16 equals the Hugging Face folder; block-format experts stay
blocks; K-quant (Q4_K_M-style) files read as gguf-py dequantizes them; drafters stay lossless on a quantized target."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.engine import Engine
from runtime.errors import LoadError
from runtime.experts import ExpertCache
from runtime.formats.quant_linear import QuantEmbedding, QuantLinear
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.loading_gguf import load_target_gguf, load_tokenizer_gguf, read_target_config
from runtime.models.layers import SparseMoe
from runtime.speculative import generate_ids
from setup_wizard.convert_target import convert_target
from tests.runtime.tiny import single_thread  # noqa: F401
from tests.setup_wizard.target_gguf_helpers import (
    BUNDLED,
    corpus,
    llamacpp_block_gguf,
    llamacpp_style_gguf,
    make_bpe_target,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _greedy(model, ids: list[int], n: int, drafter=None, block: int = 1) -> list[int]:
    kv = KVCache(model.cfg.num_hidden_layers, model.cfg.num_key_value_heads, model.cfg.head_dim, 512,
                 dtype=torch.float32, device="cpu")
    return generate_ids(model, kv, ids, drafter=drafter, max_new_tokens=n, block=block, stop_ids=set()).token_ids


def _prompts(tok, n: int = 3, length: int = 48) -> list[list[int]]:
    return [tok.encode(t).ids[:length] for t in corpus()[:n]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    src = make_bpe_target(root, style="qwen2", seed=1)
    out = {q: convert_target(src, q, root / q / "model.gguf") for q in ("bf16", "q8_0", "q4_0")}
    return src, out, root


def test_bf16_file_equals_folder(files):
    src, out, _ = files
    hf = load_target(src, with_mtp=True)
    gg = load_target_gguf(out["bf16"].path, with_mtp=True)
    tok = load_tokenizer_gguf(out["bf16"].path)
    ids = torch.tensor([_prompts(tok)[0]])
    a, b = hf(ids), gg(ids)
    assert torch.equal(a.logits, b.logits)            # the same fp32 weights, the same modules
    assert torch.equal(hf.mtp_logits(ids, a.hidden), gg.mtp_logits(ids, b.hidden))
    for p in _prompts(tok):
        assert _greedy(hf, p, 16) == _greedy(gg, p, 16)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_gguf_py_file_gives_our_tokens(files, quant):
    """A file written by gguf-py's own writer and quantizer in llama.cpp's layout (no strata.* keys, no MTP file)
    loads and gives the same greedy tokens as Strata's conversion of the same checkpoint."""
    src, out, root = files
    ref = llamacpp_style_gguf(src, root / f"ref-{quant}.gguf", quant, pre="qwen2")
    a = load_target_gguf(out[quant].path, with_mtp=False)
    b = load_target_gguf(ref)
    assert b.mtp is None and read_target_config(ref).mtp_layers == 0
    tok = load_tokenizer_gguf(ref)
    for p in _prompts(tok):
        assert _greedy(a, p, 16) == _greedy(b, p, 16)


def test_block_experts_are_never_floats(files):
    _, out, _ = files
    m = load_target_gguf(out["q4_0"].path, with_mtp=True)
    assert isinstance(m.model.embed_tokens, QuantEmbedding) and isinstance(m.lm_head, QuantLinear)
    assert isinstance(m.model.layers[0].self_attn.q_proj, QuantLinear)
    for blk in [layer.mlp for layer in m.model.layers] + [m.mtp.layers[0].mlp]:
        assert isinstance(blk, SparseMoe) and blk.fmt == "q4_0" and blk.gate_up.dtype == torch.uint8
        assert blk.gate_up.shape == (4, 2 * 32, 64 // 32 * 18) and blk.down.shape == (4, 64, 32 // 32 * 18)
        assert not list(blk.experts.parameters())              # no float expert weight anywhere
    # router and norms are F32 in the file: floats here
    assert m.model.layers[0].mlp.gate.weight.dtype == torch.float32


def test_q8_0_agreement_measured(files):
    """Next-token top-1 agreement of the Q8_0 and Q4_0 files with BF16 on held-out prompts (teacher-forced)."""
    _, out, _ = files
    ref = load_target_gguf(out["bf16"].path, with_mtp=False)
    tok = load_tokenizer_gguf(out["bf16"].path)
    ids = torch.tensor(_prompts(tok, 4, 96))
    top = ref(ids).logits.argmax(-1)
    agree = {}
    for q in ("q8_0", "q4_0"):
        m = load_target_gguf(out[q].path, with_mtp=False)
        agree[q] = (m(ids).logits.argmax(-1) == top).float().mean().item()
    print("top-1 agreement with BF16:", agree)
    assert agree["q8_0"] >= 0.95
    assert agree["q8_0"] >= agree["q4_0"] - 0.02


def test_block_experts_in_the_expert_cache(files):
    """Block experts count as blocks in the expert cache; a partial cache of them (3 of 8 experts a layer's worth of
    slots, the rest streamed through dynamic slots) gives the all-resident greedy tokens, through the decode path
    and the prefill path, and counts its misses; policies that compute float experts are refused in one sentence."""
    from runtime.errors import UsageError

    _, out, _ = files
    for quant in ("q8_0", "q4_0"):
        m = load_target_gguf(out[quant].path, with_mtp=False)
        p = _prompts(load_tokenizer_gguf(out[quant].path))[0]
        want = _greedy(m, p, 12)
        cache = ExpertCache(m, torch.device("cpu"))
        cache.place(m)
        assert _greedy(m, p, 12) == want
        if quant == "q8_0":
            assert cache.expert_nbytes == 3 * 32 * (64 // 32 * 34)      # gate, up, down of one expert as Q8_0 rows
            assert cache.resident_nbytes == cache.expert_nbytes * cache.total
        for miss in ("cpu", "legacy"):
            with pytest.raises(UsageError, match="quantized target serves the experts .* by streaming"):
                ExpertCache(m, torch.device("cpu"), slots=3, enforce_on_cpu=True, miss=miss)
        n_layers = len(m.model.layers)
        part = ExpertCache(m, torch.device("cpu"), slots=3 * n_layers, enforce_on_cpu=True, miss="auto")
        part.place(m)
        part.ensure_window(1)
        assert part.mode == "pool" and part.miss == "stream" and part.fmt == quant
        assert part.resident_nbytes == part.expert_nbytes * 3 * n_layers
        assert _greedy(m, p, 12) == want, quant
        st = part.stats()
        assert st["misses"] > 0 and st["fetched"] > 0 and st["hit_rate"] < 1.0
        with pytest.raises(UsageError, match="at least one expert slot"):
            ExpertCache(m, torch.device("cpu"), slots=0, enforce_on_cpu=True).ensure_window(1)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_mtp_lossless_on_quantized_target(files, quant):
    _, out, _ = files
    # floor 0: every window proposes (an unconfigured floor is the kind's default, 0.5, which this head rarely passes)
    eng = Engine.build(out[quant].path, drafter_kind="mtp", device="cpu", context=512, block=4, spec_min_p=0.0)
    for text in corpus()[:2]:
        a = eng.generate(text[:300], max_new_tokens=20)
        b = eng.generate(text[:300], max_new_tokens=20, draft=False)
        assert a.token_ids == b.token_ids and a.stats["proposed"] > 0


def test_bundled_pack_q8_0_with_both_drafters(tmp_path):
    """The bundled pack as a Q8_0 GGUF: MTP and DFlash2 drafts leave the greedy output unchanged."""
    res = convert_target(BUNDLED, "q8_0", tmp_path / "model.gguf")
    head = BUNDLED.parent / "strata-nano-dflash2"
    prompt = corpus()[0][:400]
    base = Engine.build(res.path, device="cpu", context=1024).generate(prompt, max_new_tokens=24).token_ids
    for kind, path in (("mtp", None), ("dflash2", head)):
        eng = Engine.build(res.path, drafter_kind=kind, drafter_path=path, device="cpu", context=1024)
        r = eng.generate(prompt, max_new_tokens=24)
        assert r.token_ids == base, kind
        assert r.stats["proposed"] > 0


def test_engine_memory_report_counts_blocks(files):
    _, out, _ = files
    eng = Engine.build(out["q4_0"].path, device="cpu", context=64)
    rep = eng.memory_report()
    m = eng.model
    blocks = sum(b.numel() for n, b in m.named_buffers() if n.endswith("blocks") and ".experts." not in n
                 and not n.startswith("mtp."))
    floats = sum(p.numel() * 4 for n, p in m.named_parameters() if not n.startswith("mtp."))
    assert rep["target_dense_weights"] == blocks + floats
    assert rep["expert_cache"] == sum(layer.mlp.gate_up.numel() + layer.mlp.down.numel() for layer in m.model.layers)
    mtp = Engine.build(out["q4_0"].path, drafter_kind="mtp", device="cpu", context=64).memory_report()
    from runtime.formats.target_gguf import read_geometry
    from runtime.models.target_config import TargetGeometry

    geo: TargetGeometry = read_geometry(out["q4_0"].path)
    assert mtp["drafter_weights"] == geo.mtp_bytes(4) and rep["target_dense_weights"] == geo.dense_bytes(4)
    assert rep["scratch"] == m.rotary.inv_freq.numel() * 4


# ------------------------------------------------------------------------------------------------------------------
# K-quants and IQ4: a file mixing Q4_K (or Q5_K, ...) and Q6_K, as llama-quantize's Q4_K_M (Q5_K_M, ...) does

@pytest.mark.parametrize("main", ["Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL"])
def test_kquant_mix_reads_as_gguf_py_dequantizes(tmp_path, main):
    out, ref_path, deq = llamacpp_block_gguf(tmp_path, main)
    m = load_target_gguf(out)
    blk = m.model.layers[0].mlp
    assert blk.fmt == (main.lower(), "q6_k")
    # the same model with gguf-py's dequantized floats in place of every block tensor
    ref = load_target_gguf(ref_path)
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(torch.from_numpy(deq["token_embd.weight"]))
        ref.lm_head.weight.copy_(torch.from_numpy(deq["output.weight"]))
        for i, layer in enumerate(ref.model.layers):
            a = layer.self_attn
            for proj, g in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                getattr(a, proj).weight.copy_(torch.from_numpy(deq[f"blk.{i}.{g}.weight"]))
            for e, ex in enumerate(layer.mlp.experts):
                ex.gate_proj.weight.copy_(torch.from_numpy(deq[f"blk.{i}.ffn_gate_exps.weight"][e]))
                ex.up_proj.weight.copy_(torch.from_numpy(deq[f"blk.{i}.ffn_up_exps.weight"][e]))
                ex.down_proj.weight.copy_(torch.from_numpy(deq[f"blk.{i}.ffn_down_exps.weight"][e]))
    ids = torch.tensor([list(range(3, 40))])
    torch.testing.assert_close(m(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_unread_block_type_one_sentence(tmp_path):
    """A file with a tensor in a block type Strata does not read (IQ3_XXS, of llama.cpp's IQ3_XXS files) is refused
    in one sentence naming the tensor, its type and the types Strata reads."""
    out, _, _ = llamacpp_block_gguf(tmp_path, "Q4_K", lambda n: "IQ3_XXS" if n == "blk.1.attn_q.weight" else "Q4_K")
    with pytest.raises(LoadError) as e:
        load_target_gguf(out)
    assert str(e.value) == ("q4_k_m.gguf: tensor blk.1.attn_q.weight is stored as IQ3_XXS, which Strata does not "
                            "read (it reads F32, F16, BF16, Q8_0, Q5_0, Q4_0, Q6_K, Q4_K, Q5_K, Q3_K, Q2_K, IQ4_XS, "
                            "IQ4_NL); use a file of those types.")


def test_bad_files_one_sentence(tmp_path, files):
    _, out, _ = files
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(LoadError, match="not a readable GGUF"):
        load_target_gguf(junk)
    drafter = tmp_path / "d" / "model.gguf"
    from setup_wizard.convert import convert_dflash2

    convert_dflash2(BUNDLED.parent / "strata-nano-dflash2", "bf16", drafter)
    with pytest.raises(LoadError, match="holds a 'dflash2' model"):
        load_target_gguf(drafter)
    # the MTP file missing beside a target that names it
    lonely = tmp_path / "lonely" / "model.gguf"
    lonely.parent.mkdir()
    lonely.write_bytes(out["q8_0"].path.read_bytes())
    with pytest.raises(LoadError, match="MTP head mtp.gguf, which is missing"):
        load_target_gguf(lonely, with_mtp=True)
    assert load_target_gguf(lonely, with_mtp=False).mtp is None
    # an MTP file from another conversion
    (lonely.parent / "mtp.gguf").write_bytes(out["q4_0"].mtp_path.read_bytes())
    with pytest.raises(LoadError, match="was not converted with"):
        load_target_gguf(lonely, with_mtp=True)


def test_split_gguf_reads_as_one_file(tmp_path, files):
    """A target written in parts (gguf-py's sharded writer, as llama.cpp's `--split-max-tensors` names them) loads
    from its first part to the same model as the same target in one file: logits bit for bit, the same budget
    geometry, the tokenizer from the first part's metadata; the engine and setup's hashing take it too."""
    from runtime.formats.target_gguf import read_geometry
    from setup_wizard.inspection import hash_target, target_files

    src, _, _ = files
    one = llamacpp_style_gguf(src, tmp_path / "one" / "m.gguf", "q8_0", pre="qwen2")
    first = llamacpp_style_gguf(src, tmp_path / "split" / "m.gguf", "q8_0", pre="qwen2", split_max_tensors=10)
    names = sorted(p.name for p in first.parent.iterdir())
    assert first.name == "m-00001-of-00003.gguf" and names == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    a, b = load_target_gguf(one), load_target_gguf(first)
    tok = load_tokenizer_gguf(first)
    ids = torch.tensor([_prompts(tok)[0]])
    assert torch.equal(a(ids).logits, b(ids).logits)
    assert read_geometry(first) == read_geometry(one)
    assert target_files(first) == names
    art = hash_target(first)
    assert sorted(art.files) == names and art.size == sum(p.stat().st_size for p in first.parent.iterdir())
    eng = Engine.build(first, device="cpu")
    assert eng.generate(tok.encode("def f():").ids, max_new_tokens=4).token_ids == \
        _greedy(a, tok.encode("def f():").ids, 4)


def test_split_gguf_refusals(tmp_path, files):
    """One sentence each: a part other than the first given (names the first), a part missing beside the first,
    parts of two uploads mixed (a part's own split.no disagrees with its name)."""
    src, _, _ = files
    first = llamacpp_style_gguf(src, tmp_path / "s" / "m.gguf", "q8_0", pre="qwen2", split_max_tensors=10)
    d = first.parent
    with pytest.raises(LoadError) as e:
        load_target_gguf(d / "m-00002-of-00003.gguf")
    assert str(e.value) == (f"{d / 'm-00002-of-00003.gguf'} is part 2 of a split GGUF file; give its first part, "
                            "m-00001-of-00003.gguf.")
    (d / "m-00003-of-00003.gguf").rename(tmp_path / "away.gguf")
    with pytest.raises(LoadError) as e:
        load_target_gguf(first)
    assert str(e.value) == ("m-00001-of-00003.gguf is the first of 3 parts of a split GGUF file and part 3, "
                            "m-00003-of-00003.gguf, is missing beside it; download every part.")
    (d / "m-00002-of-00003.gguf").rename(d / "m-00003-of-00003.gguf")       # part 2's bytes named part 3
    (tmp_path / "away.gguf").rename(d / "m-00002-of-00003.gguf")
    with pytest.raises(LoadError, match=r"m-00002-of-00003.gguf says it is part 2 \(from 0\) of 3, not part 1 of 3"):
        load_target_gguf(first)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_quantized_fused_step_in_interpreter():
    """The GPU path of a quantized target (fused step: block q/k/v, o_proj, lm_head, embedding and experts) under the
    Triton interpreter against the plain forward (tests/runtime/kernels_check.py gguf)."""
    script = Path(__file__).with_name("kernels_check.py")
    r = subprocess.run([sys.executable, str(script), "gguf"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "gguf step ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
@pytest.mark.parametrize("mix", ["q4_k_m"])
def test_kquant_mix_fused_step_in_interpreter(mix):
    """A Q4_K_M-style target (q and k Q4_K, v and the experts' down Q6_K in one layer) runs the fused step, q and k
    stacked alone, against the plain forward (tests/runtime/kernels_check.py kquant_mix). The Q5_K_M and Q3_K_M
    mixes pass the same check (`kernels_check.py kquant_mix q5_k_m`, `... q3_k_m`; `... q3_k_m
    dot`: the Q3_K products off the matrix-vector tiles, a path no shipped format takes since every format has GEMV
    code) but stay out of CI's time: their products are the kernels check_moe_gemv, check_moe_quant and
    check_dequant test."""
    script = Path(__file__).with_name("kernels_check.py")
    r = subprocess.run([sys.executable, str(script), "kquant_mix", *mix.split()], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "gguf step ok" in r.stdout, r.stderr[-3000:]
