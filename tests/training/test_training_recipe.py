"""The strata-nano recipe at toy size on CPU: every stage runs, its loss falls, and what it writes loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from runtime.drafters.dflash2.contract import DFlash2Geometry, check_inventory
from runtime.engine import Engine
from runtime.loading import load_target, load_tokenizer
from training import corpus, run_all
from training.configs import TOY
from training.export import untar_safely
from training.tok import EOS, EOS_TOKEN, MASK, MASK_TOKEN


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("toydata")
    corpus.build(d, vocab_size=TOY.geometry.vocab, max_files=40)
    return d


@pytest.fixture(scope="module")
def toy_run(toy_data, tmp_path_factory) -> tuple[dict, Path, Path]:
    torch.set_num_threads(1)
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    m = run_all.run(TOY, toy_data, out, work, torch.device("cpu"), resume=None, deadline_s=300, quiet=True)
    return m, out, work


def test_tokenizer_has_eos_and_mask_and_round_trips(toy_data):
    tok = load_tokenizer(toy_data)
    assert tok.token_to_id(EOS_TOKEN) == EOS == 0 and tok.token_to_id(MASK_TOKEN) == MASK == 1
    src = "def f(x):\n    return {'a': [x, 2.5]}  # é\n"
    assert tok.decode(tok.encode(src).ids) == src
    assert tok.get_vocab_size() == TOY.geometry.vocab


def test_held_out_modules_are_never_trained_on(toy_data):
    m = json.loads((toy_data / "manifest.json").read_text())
    assert m["eval_documents"] and all(corpus.is_held_out(r) for r in m["eval_documents"])
    assert corpus.is_held_out("json/decoder.py") and corpus.is_held_out("test/test_json/test_dump.py")
    assert corpus.is_held_out("textwrap.py") and not corpus.is_held_out("textwrap2.py")
    assert not corpus.is_held_out("jsonschema.py") and not corpus.is_held_out("test/test_jsonx.py")
    assert len(m["file_list_sha256"]) == 64 and m["python"].count(".") == 2
    arrays = corpus.load(toy_data)
    assert arrays["train"].max() < TOY.geometry.vocab and (arrays["train"] == EOS).sum() == 40


def test_every_stage_trains(toy_run):
    m, _, _ = toy_run
    st = m["stages"]
    assert st["target"]["last_ce"] < st["target"]["first"]["ce"] - 0.3
    assert st["mtp"]["last_ce"] < st["mtp"]["first_ce"]
    for head in (run_all.DRAFT, run_all.TURBO):
        assert "error" not in st[head], st[head].get("error")
        assert st[head]["last"]["ce"] < st[head]["first"]["ce"] - 0.5
        assert 1.0 <= st[head]["acceptance"][0]["tokens_per_window"] <= st[head]["acceptance"][0]["block"]
    assert m["held_out"]["ppl"] < TOY.geometry.vocab


def test_outputs_load_through_the_runtime(toy_run, tmp_path):
    _, out, _ = toy_run
    for name in (run_all.TARGET, run_all.DRAFT, run_all.TURBO):
        untar_safely(out / f"{name}.tar", tmp_path)
    target = load_target(tmp_path / run_all.TARGET)
    assert target.mtp is not None and target.cfg.num_experts == 8 and target.cfg.num_experts_per_tok == 2
    for name in (run_all.DRAFT, run_all.TURBO):
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["architectures"] == ["DFlash2DraftModel"]
        geom = DFlash2Geometry.from_config(cfg)
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
            found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        assert len(found) == 81 and {d for _, d in found.values()} == {"BF16"}
        assert check_inventory(found, geom) == "v2"
    prompt = [5, 17, 40, 41, 9, 3]
    base = Engine.build(tmp_path / run_all.TARGET, "none", device="cpu", context=256)
    ref = base.generate(prompt, max_new_tokens=12, stop_ids=set()).token_ids
    for kind, path in (("mtp", None), ("dflash2", tmp_path / run_all.DRAFT)):
        eng = Engine.build(tmp_path / run_all.TARGET, kind, drafter_path=path, device="cpu", context=256)
        res = eng.generate(prompt, max_new_tokens=12, stop_ids=set())
        assert res.token_ids == ref and res.stats["windows"] >= 1


def test_resume_skips_finished_stages(toy_run, toy_data, tmp_path):
    _, out, _ = toy_run
    m = run_all.run(TOY, toy_data, tmp_path / "o", tmp_path / "w", torch.device("cpu"), resume=out,
                    deadline_s=300, quiet=True)
    assert "resumed_from" in m["stages"]["target"]
    assert (tmp_path / "o" / f"{run_all.DRAFT}.tar").read_bytes() == (out / f"{run_all.DRAFT}.tar").read_bytes()


def test_head_finetune_continues_a_trained_head(toy_run, toy_data, tmp_path):
    from training import finetune_head

    _, _, work = toy_run
    rc = finetune_head.main(["--pack", str(work), "--data", str(toy_data), "--out", str(tmp_path / "o"),
                             "--work", str(tmp_path / "w"), "--preset", "toy", "--prompts", "8", "--prompt-len",
                             "16", "--new", "24", "--steps", "4", "--device", "cpu"])
    assert rc == 0
    st = json.loads((tmp_path / "o" / "finetune_metrics.json").read_text())
    assert st["steps"] == 4 and st["first"]["ce"] < 5.0   # starts from the trained head, not from scratch
    untar_safely(tmp_path / "o" / f"{run_all.DRAFT}.tar", tmp_path / "x")
    assert (tmp_path / "x" / run_all.DRAFT / "model.safetensors").stat().st_size > 0
