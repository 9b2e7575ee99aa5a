"""The calibration key, the result store and `calibrate_for_config` (reuse, force, no drafter) with a fake engine."""

from __future__ import annotations

import copy
import json

import pytest
import tomli_w

from calibrate.api import calibrate_for_config
from calibrate.key import CalibrationConfigError, CalibrationKey, key_for_config
from calibrate.results import ResultStore
from calibrate.search import Plan
from runtime.version import __version__
from tests.calibrate.calib_fakes import FAKE_PROMPTS, FakeClock, FakeEngine, bowl_speed

DEV = ("NVIDIA H200", 143771)


def config(kind: str = "dflash2", **over) -> dict:
    doc = {
        "schema": 1,
        "target": {"name": "strata-nano", "path": "/x/target", "sha256": "a" * 64},
        "drafter": {"kind": kind, "path": "/x/head.gguf", "sha256": "b" * 64, "quantization": "q4_0"},
        "speculative": {"block": 4, "spec_min_p": 0.5, "source": "default"},
        "memory": {"context": 4096},
        "device": {"type": "cuda", "name": DEV[0], "total_mib": DEV[1]},
    }
    if kind == "mtp":
        doc["drafter"] = {"kind": "mtp", "path": "/x/target", "sha256": "a" * 64}
    for dotted, v in over.items():
        table, k = dotted.split("__")
        doc[table][k] = v
    return doc


def key(doc: dict, device=DEV) -> CalibrationKey:
    return key_for_config(doc, device=device)


def test_identical_inputs_give_the_same_key():
    assert key(config()) == key(copy.deepcopy(config()))
    assert key(config()).digest == key(config()).digest
    k = key(config())
    assert k.to_dict() == {"device_name": "NVIDIA H200", "device_total_mib": 143771, "target_sha256": "a" * 64,
                           "drafter_kind": "dflash2", "drafter_sha256": "b" * 64, "quantization": "q4_0",
                           "context": 4096, "runtime_version": __version__, "target_quantization": "bf16",
                           "drafter_step": "", "kv_cache": ""}
    assert CalibrationKey.from_dict(k.to_dict()) == k


@pytest.mark.parametrize("change", [
    {"drafter__quantization": "q8_0"},
    {"target__quantization": "q8_0"},
    {"drafter__sha256": "c" * 64},
    {"memory__context": 8192},
    {"target__sha256": "d" * 64},
])
def test_key_differs_per_artifact_hash_quantization_context_target(change):
    assert key(config(**change)) != key(config())
    assert key(config(**change)).digest != key(config()).digest


def test_key_differs_per_drafter_kind_and_device():
    assert key(config("mtp")) != key(config("dflash2"))
    assert key(config("mtp")).drafter_kind == "mtp"
    assert key(config(), device=("NVIDIA H100", 81559)) != key(config())
    assert key(config(), device=(DEV[0], 81559)) != key(config())


def test_key_names_a_cache_out_of_the_compute_dtype():
    """An 8-bit or (on a CPU) bf16 KV cache changes what a step costs at long contexts: its own calibration; a cache
    named in the compute dtype is the same key as none named (and as the records stored before the field)."""
    assert key(config(memory__kv_dtype="q8_0")).kv_cache == "q8_0"
    assert key(config(memory__kv_dtype="q8_0")).digest != key(config()).digest
    gpu = {"memory__dtype": "bfloat16"}                                        # a GPU config computes in bf16
    assert key(config(**gpu, memory__kv_dtype="bf16")) == key(config(**gpu))
    cpu = {"device__type": "cpu"}
    assert key(config(**cpu, memory__kv_dtype="bf16")).kv_cache == "bf16"
    assert key(config(**cpu, memory__kv_dtype="bf16")).digest != key(config(**cpu)).digest
    assert key(config(**cpu, memory__kv_dtype="float32")) == key(config(**cpu))
    assert key(config(**cpu, memory__kv_dtype="bf16", memory__dtype="bf16")) == key(config(**cpu, memory__dtype="bf16"))
    k = key(config(**cpu, memory__kv_dtype="bf16"))
    assert CalibrationKey.from_dict(k.to_dict()) == k
    assert key(config()).kv_cache == ""


def test_key_ignores_what_it_does_not_name():
    assert key(config(speculative__block=7)) == key(config())       # the current settings are not in the key


def test_key_needs_hashes():
    doc = config()
    del doc["drafter"]["sha256"]
    with pytest.raises(CalibrationConfigError, match="sha256"):
        key(doc)
    doc = config()
    del doc["target"]["sha256"]
    with pytest.raises(CalibrationConfigError, match="target"):
        key(doc)
    with pytest.raises(CalibrationConfigError, match="drafter kind"):
        key(config(drafter__kind="eagle"))


def fake(clock: FakeClock, best=(5, 0.3)) -> FakeEngine:
    return FakeEngine(bowl_speed(*best), clock, max_block=8)


def calib(doc, tmp_path, engine, clock, **kw):
    return calibrate_for_config(doc, engine=engine, store_dir=tmp_path, device=DEV, prompts=FAKE_PROMPTS,
                                new_tokens=16, clock=clock, max_seconds=None, **kw)


def test_calibrate_stores_then_reuses_then_forces(tmp_path):
    clock = FakeClock()
    eng = fake(clock)
    res = calib(config(), tmp_path, eng, clock)
    assert (res.block, res.spec_min_p, res.source, res.reused) == (5, 0.3, "calibrated", False)
    stored = json.loads((tmp_path / f"{key(config()).digest}.json").read_text())
    assert stored["key"] == key(config()).to_dict()
    for field in ("settings", "per_task_tok_s", "accepted", "proposed", "seconds", "date", "default", "winner",
                  "reason", "arms"):
        assert field in stored, field
    assert set(stored["per_task_tok_s"]) == {"code", "math", "prose", "long"}
    assert stored["default"]["block"] == 4 and stored["default"]["spec_min_p"] == 0.5
    assert stored["default_from"] == "engine"

    n = len(eng.calls)
    again = calib(config(), tmp_path, eng, clock)
    assert again.reused and len(eng.calls) == n                     # nothing measured
    assert (again.block, again.spec_min_p) == (5, 0.3) and again.record["date"] == stored["date"]

    other = calib(config(drafter__quantization="q8_0"), tmp_path, eng, clock)   # another key: measured
    assert not other.reused and len(eng.calls) > n

    n = len(eng.calls)
    forced = calib(config(), tmp_path, fake(clock, best=(3, 0.0)), clock, force=True)
    assert not forced.reused and (forced.block, forced.spec_min_p) == (3, 0.0)
    assert calib(config(), tmp_path, eng, clock).block == 3          # the forced result replaced the old one


def test_a_damaged_or_foreign_record_is_not_reused(tmp_path):
    clock = FakeClock()
    k = key(config())
    store = ResultStore(tmp_path)
    store.path_for(k).parent.mkdir(parents=True, exist_ok=True)
    store.path_for(k).write_text("{ not json")
    assert store.load(k) is None
    rec = {"settings": {"block": 2, "spec_min_p": 0.0}}
    store.save(key(config(memory__context=8192)), rec)
    # a record whose inner key differs is ignored even under this key's file name
    store.path_for(k).write_text(store.path_for(key(config(memory__context=8192))).read_text())
    assert store.load(k) is None
    res = calib(config(), tmp_path, fake(clock), clock)
    assert not res.reused and res.block == 5
    assert not list(tmp_path.glob(".*.tmp"))                        # atomic writes leave no temp files


def test_no_drafter_has_nothing_to_calibrate(tmp_path):
    doc = config()
    doc["drafter"] = {"kind": "none"}
    res = calibrate_for_config(doc, store_dir=tmp_path, device=DEV)
    assert res.block is None and res.decision == "nothing_to_calibrate" and "nothing to calibrate" in res.reason
    assert res.to_dict()["source"] == "default"
    assert not list(tmp_path.iterdir())


def test_result_dict_is_toml_safe_and_reads_back(tmp_path):
    clock = FakeClock()
    res = calib(config(), tmp_path, fake(clock), clock)
    table = res.to_dict()
    text = tomli_w.dumps({"calibration": table})
    assert "block = 5" in text
    assert table["key"] == key(config()).to_dict() and table["decision"] == "winner"
    assert table["default"]["block"] == 4 and table["winner"]["block"] == 5
    json.dumps(res.to_json())


def test_wizard_entry_point_returns_the_table(tmp_path):
    clock = FakeClock()
    out = calibrate_for_config(config(), engine=fake(clock), store_dir=tmp_path, device=DEV, prompts=FAKE_PROMPTS,
                               new_tokens=16, clock=clock, plan=Plan(confirm_repeats=1)).to_dict()
    assert out["block"] == 5 and out["spec_min_p"] == 0.3 and out["source"] == "calibrated"
    assert out["budget_s"] == 110.0


def test_config_file_path_and_bad_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("schema = 1\n[drafter]\nkind = 'none'\n")
    assert calibrate_for_config(p, store_dir=tmp_path).decision == "nothing_to_calibrate"
    p.write_text("not = [toml")
    with pytest.raises(CalibrationConfigError, match="not valid TOML"):
        calibrate_for_config(p, store_dir=tmp_path)
    with pytest.raises(CalibrationConfigError, match="cannot read"):
        calibrate_for_config(tmp_path / "missing.toml", store_dir=tmp_path)
