"""The shipped strata-nano pack: pinned in the catalog, the DFlash2 contract, size, and it runs losslessly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from runtime.drafters.dflash2.contract import DFlash2Geometry, check_inventory, tensor_count
from runtime.engine import Engine
from setup_wizard.catalog import load_catalog
from training import pin

HEADS = ("strata-nano-dflash2", "strata-nano-dflash2-turbo")
pytestmark = pytest.mark.skipif(not (pin.BUNDLED / "strata-nano" / "model.safetensors").is_file(),
                                reason="bundled pack not present")


def test_catalog_pins_match_the_shipped_folders():
    assert pin.main(["--check"]) == 0
    cat = load_catalog(extra=None)
    for name in ("strata-nano", *HEADS):
        e = cat.get(name)
        pins = pin.file_pins(pin.BUNDLED / name)
        assert e.source == "bundled" and e.repo == name and e.pinned
        assert e.revision == pin.revision_of(pins)
        assert {(f.path, f.sha256, f.size) for f in e.files} == set(pins)
    assert cat.default_head("strata-nano").name == "strata-nano-dflash2"


def test_pin_detects_a_changed_file(tmp_path):
    import shutil

    b = tmp_path / "bundled"
    for name in ("strata-nano", *HEADS):
        shutil.copytree(pin.BUNDLED / name, b / name)
    cat = tmp_path / "catalog.toml"
    cat.write_text(f"schema = 1\n{pin.BEGIN}\n{pin.END}\n")
    assert pin.main(["--catalog", str(cat), "--bundled", str(b)]) == 0
    assert pin.main(["--catalog", str(cat), "--bundled", str(b), "--check"]) == 0
    (b / HEADS[0] / "config.json").write_text((b / HEADS[0] / "config.json").read_text() + " ")
    assert pin.main(["--catalog", str(cat), "--bundled", str(b), "--check"]) == 1
    cat.write_text("schema = 1\n")
    assert pin.main(["--catalog", str(cat), "--bundled", str(b)]) == 2


def test_pack_is_bf16_small_and_follows_the_contract():
    total = sum(f.stat().st_size for d in pin.BUNDLED.iterdir() if d.is_dir() for f in d.iterdir())
    assert total < 40_000_000
    tcfg = json.loads((pin.BUNDLED / "strata-nano" / "config.json").read_text())
    assert tcfg["model_type"] == "qwen3_moe" and tcfg["num_experts"] >= 8 and tcfg["num_experts_per_tok"] == 2
    with safe_open(str(pin.BUNDLED / "strata-nano" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert any(k.startswith("mtp.") for k in f.keys())
    for head in HEADS:
        cfg = json.loads((pin.BUNDLED / head / "config.json").read_text())
        geom = DFlash2Geometry.from_config(cfg)
        # the turbo head has the official 5 layers; the default head may be shallower (training/train_head.py)
        assert (geom.num_layers == 5 if head.endswith("turbo") else 1 <= geom.num_layers <= 5)
        assert geom.head_dim == 128 and geom.conv_kernel_size == 2
        assert geom.conv_group_size == 16 and geom.selector_top_k == 16 and geom.block_size >= 8
        assert geom.vocab_size == tcfg["vocab_size"] and geom.hidden_size == tcfg["hidden_size"]
        assert max(geom.target_layer_ids) < tcfg["num_hidden_layers"]
        with safe_open(str(pin.BUNDLED / head / "model.safetensors"), "pt") as f:
            found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        assert len(found) == tensor_count(geom.num_layers) and check_inventory(found, geom) == "v2"


def test_pack_generates_python_and_drafts_losslessly():
    torch.set_num_threads(1)
    target = pin.BUNDLED / "strata-nano"
    base = Engine.build(target, "none", device="cpu", context=512)
    prompt = "import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n"
    ref = base.generate(prompt, max_new_tokens=24)
    assert len(ref.token_ids) >= 8 and ("    " in ref.text or "\n" in ref.text)
    for kind, path in (("mtp", None), ("dflash2", pin.BUNDLED / HEADS[0])):
        eng = Engine.build(target, kind, drafter_path=path, device="cpu", context=512)
        res = eng.generate(prompt, max_new_tokens=24)
        assert res.token_ids == ref.token_ids
        assert res.stats["accepted"] > 0      # trained drafters get something right on code
