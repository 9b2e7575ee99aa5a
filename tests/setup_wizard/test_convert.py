"""DFlash2 -> GGUF converter: round trip through GGUFReader, byte equality, contract errors, the cache."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import quantize as gguf_quantize

from runtime.drafters.dflash2.contract import hf_to_gguf
from runtime.errors import ContractError
from runtime.formats.gguf_meta import metadata
from setup_wizard.convert import (
    CONVERTER_VERSION,
    check_gguf,
    convert_dflash2,
    convert_to_store,
)
from setup_wizard.store import Store
from tests.setup_wizard.hub_helpers import TINY_CONFIG, tiny_tensors, write_checkpoint

BACKBONE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc.weight")


def _is_backbone(name: str) -> bool:
    return any(k in name for k in BACKBONE)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "head")


def test_local_conversion_still_writes_every_strata_key(ckpt, tmp_path):
    """A standalone convert of a local folder has no repo or revision; the keys are present and empty."""
    out = tmp_path / "local.gguf"
    res = convert_dflash2(ckpt, "q8_0", out)
    meta = metadata(GGUFReader(out))
    assert meta["strata.source.repo"] == "" and meta["strata.source.revision"] == ""
    assert meta["strata.source.sha256"] == res.source_sha256 and meta["strata.quantization"] == "q8_0"


@pytest.mark.parametrize("quant", ["bf16", "q8_0", "q5_0", "q4_0"])
def test_round_trip_bytes_and_metadata(ckpt, tmp_path, quant):
    out = tmp_path / f"head-{quant}.gguf"
    res = convert_dflash2(ckpt, quant, out, source_repo="org/head", source_revision="a" * 40)
    assert res.path == out and out.is_file() and not list(tmp_path.glob(".*.tmp"))
    r = GGUFReader(out)
    meta = metadata(r)
    assert meta["general.architecture"] == "dflash2"
    assert meta["general.file_type"] == {"bf16": 32, "q8_0": 7, "q5_0": 8, "q4_0": 2}[quant]
    assert meta["general.alignment"] == 32
    assert meta["strata.quantization"] == quant and meta["strata.converter_version"] == CONVERTER_VERSION
    assert meta["strata.source.repo"] == "org/head" and meta["strata.source.revision"] == "a" * 40
    assert meta["strata.source.sha256"] == res.source_sha256
    assert meta["dflash2.embedding_length"] == 64 and meta["dflash2.block_count"] == 2
    assert list(meta["dflash2.target_layers"]) == [1, 3] and meta["dflash2.mask_token_id"] == 127
    assert meta["dflash2.attention.sliding_window"] == 0 and meta["dflash2.final_logit_softcapping"] == 0.0
    tensors = tiny_tensors()
    assert len(r.tensors) == 15 * 2 + 6
    by_name = {t.name: t for t in r.tensors}
    n_quant = 0
    for name, t in tensors.items():
        g = by_name[hf_to_gguf(name)]
        bits = t.view(torch.int16).numpy().view(np.uint16)
        assert tuple(reversed([int(d) for d in g.shape])) == tuple(t.shape)
        raw = np.asarray(g.data).view(np.uint8).tobytes()
        if quant != "bf16" and _is_backbone(name):
            n_quant += 1
            gt = GGMLQuantizationType[quant.upper()]
            x = (bits.astype(np.uint32) << 16).view(np.float32).reshape(-1, t.shape[-1])
            assert g.tensor_type == gt
            assert raw == gguf_quantize(x, gt).tobytes(), name
        else:
            assert g.tensor_type == GGMLQuantizationType.BF16
            assert raw == bits.tobytes(), name  # BF16 passthrough, bit-exact
    assert n_quant == (0 if quant == "bf16" else 2 * 7 + 1)
    assert check_gguf(out, None, quant, res.source_sha256) == []


def test_gguf_dump_reads_the_output(ckpt, tmp_path):
    out = tmp_path / "h.gguf"
    convert_dflash2(ckpt, "q4_0", out)
    exe = shutil.which("gguf-dump") or str(Path(sys.executable).parent / "gguf-dump")
    p = subprocess.run([exe, "--no-tensors", str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "dflash2.block_count" in p.stdout and "strata.quantization" in p.stdout


def _broken(tmp_path, mutate) -> Path:
    t = tiny_tensors()
    cfg = dict(TINY_CONFIG)
    mutate(t, cfg)
    return write_checkpoint(tmp_path / "bad", config=cfg, tensors=t)


CASES = {
    "missing": (lambda t, c: t.pop("layers.1.mlp_conv.base_kernel"), "missing tensor 'layers.1.mlp_conv.base_kernel'"),
    "extra": (lambda t, c: t.__setitem__("lm_head.weight", torch.zeros(128, 64, dtype=torch.bfloat16)),
              "unexpected tensor 'lm_head.weight'"),
    "misshaped": (lambda t, c: t.__setitem__("norm.weight", torch.ones(32, dtype=torch.bfloat16)),
                  "'norm.weight' has shape [32], expected [64]"),
    "dtype": (lambda t, c: t.__setitem__("fc.weight", t["fc.weight"].float()), "'fc.weight' has dtype F32"),
    "nan": (lambda t, c: t["layers.0.mlp.up_proj.weight"].__setitem__((3, 5), float("nan")),
            "'layers.0.mlp.up_proj.weight' holds NaN or infinite"),
    "inf": (lambda t, c: t["layers.1.attention_conv.base_kernel"].__setitem__((0, 0, 0), float("inf")),
            "'layers.1.attention_conv.base_kernel' holds NaN or infinite"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_contract_violations_write_nothing(tmp_path, case):
    mutate, msg = CASES[case]
    src = _broken(tmp_path, mutate)
    out = tmp_path / "out" / "x.gguf"
    with pytest.raises(ContractError) as ei:
        convert_dflash2(src, "q8_0", out)
    assert msg in str(ei.value)
    assert not out.exists()
    assert not out.parent.exists() or not list(out.parent.iterdir())  # no temp file either


def test_row_not_multiple_of_32_names_the_tensor(tmp_path):
    cfg = {**TINY_CONFIG, "intermediate_size": 80}
    src = write_checkpoint(tmp_path / "odd", config=cfg, tensors=tiny_tensors(cfg))
    out = tmp_path / "odd.gguf"
    with pytest.raises(ContractError, match=r"'layers.0.mlp.down_proj.weight' has rows of 80 values.*--quant bf16"):
        convert_dflash2(src, "q5_0", out)
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))
    convert_dflash2(src, "bf16", out)  # BF16 needs no blocks
    assert check_gguf(out, None, "bf16", None) == []


def test_cache_reuses_checked_file_and_rebuilds_truncated_or_foreign(ckpt, tmp_path, home):
    store = Store()
    a = convert_to_store(ckpt, "q8_0", store)
    assert not a.reused and a.path.is_file()
    assert a.path.parent.parent == home / "converted"
    b = convert_to_store(ckpt, "q8_0", store)
    assert b.reused and b.sha256 == a.sha256
    good = a.path.read_bytes()
    # truncated: rebuilt
    a.path.write_bytes(good[: len(good) // 2])
    c = convert_to_store(ckpt, "q8_0", store)
    assert not c.reused and c.path.read_bytes() == good
    # foreign file of the same size (another quant's bytes padded): rebuilt
    other = tmp_path / "o.gguf"
    convert_dflash2(ckpt, "q4_0", other)
    ob = other.read_bytes()
    a.path.write_bytes((ob + b"\0" * len(good))[: len(good)])
    d = convert_to_store(ckpt, "q8_0", store)
    assert not d.reused and d.path.read_bytes() == good
    # another quant is another artifact
    e = convert_to_store(ckpt, "q4_0", store)
    assert e.path != a.path and not e.reused


def test_sharded_source_converts_to_the_same_tensors(ckpt, tmp_path):
    import json

    from safetensors.torch import save_file

    t = tiny_tensors()
    names = sorted(t)
    half = len(names) // 2
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fn, ns in shards.items():
        save_file({n: t[n] for n in ns}, str(d / fn))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: fn for fn, ns in shards.items() for n in ns}}))
    a = convert_dflash2(ckpt, "q4_0", tmp_path / "a.gguf")
    b = convert_dflash2(d, "q4_0", tmp_path / "b.gguf")
    assert a.source_sha256 != b.source_sha256
    ra, rb = GGUFReader(a.path), GGUFReader(b.path)
    assert [(x.name, bytes(np.asarray(x.data).tobytes())) for x in ra.tensors] == \
        [(x.name, bytes(np.asarray(x.data).tobytes())) for x in rb.tensors]


def test_pulled_head_converts_through_the_cache(tiny_repo, hub, home):
    from setup_wizard.hub import pull

    p = pull("tiny-head")
    sha = p.files["model.safetensors"]["sha256"]
    c = convert_to_store(p.path, "q8_0", source_name="tiny-head", source_repo="tiny-org/tiny-dflash2",
                         source_revision=p.revision, source_sha=sha)
    meta = metadata(GGUFReader(c.path))
    assert meta["strata.source.sha256"] == sha and meta["strata.source.revision"] == p.revision
    items = {it.name: it for it in Store().items()}
    assert items["tiny-head:q8_0"].verified and items["tiny-head:q8_0"].artifact_path == c.path
