"""The scripted setup through typer's CliRunner: --yes defaults, conflicts, bad values, non-TTY, reruns."""

from __future__ import annotations

import json
import tomllib

import pytest
from typer.testing import CliRunner

from runtime.drafters.dflash2.contract import DFlash2Geometry, weight_bytes
from setup_wizard.cli import app
from setup_wizard.inspection import target_geometry
from tests.setup_wizard.wizard_fakes import fake_cpu


def run(*args):
    return CliRunner().invoke(app, list(args))


def one_sentence_error(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1, res.output
    assert lines[0].startswith("Error: ")
    for n in needles:
        assert n in lines[0], lines[0]


def files_under(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) if path.exists() else []


def test_no_terminal_and_no_yes_exits_2_naming_the_flags(machine, home):
    res = run()
    one_sentence_error(res, "--yes", "--drafter", "--answers")
    assert files_under(home) == []


def test_yes_takes_recommended_answers(machine, home, services, pack):
    res = run("--yes")
    assert res.exit_code == 0, res.output
    cfg_path = home / "configs" / "nano-mtp.toml"
    doc = tomllib.loads(cfg_path.read_text())
    assert doc["schema"] == 1
    assert doc["target"]["name"] == "nano" and doc["drafter"]["kind"] == "mtp"
    assert doc["memory"]["context"] == 4096  # the tiny model's limit; everything fits
    assert doc["memory"]["reserve_mib"] == 512  # GPU default
    assert doc["device"]["type"] == "cuda" and doc["memory"]["dtype"] == "bf16"
    # calibration ran once and its choice is in the config with its provenance
    assert [c[0] for c in services.calls] == ["fetch", "calibrate"]
    assert doc["speculative"] == {"block": 3, "spec_min_p": 0.3, "source": "calibrated"}
    assert doc["calibration"]["decision"] == "winner" and doc["calibration"]["status"] == "calibrated"
    # the exact command to run is printed (no wrapping inside it)
    assert f"strata-run --config {cfg_path} --prompt Hello" in res.output
    assert f"strata-serve --config {cfg_path}" in res.output
    # budget table items in the config add up with the slots
    b = doc["memory"]["budget"]
    geo = target_geometry(pack["nano"])
    assert b["target_dense_weights"] == geo.dense_elems() * 2
    assert b["drafter_weights"] == geo.mtp_elems() * 2
    assert b["expert_cache"] == doc["memory"]["expert_cache_slots"] * geo.expert_elems() * 2
    assert doc["memory"]["expert_cache_slots"] == geo.total_experts


def test_rerun_reuses_calibration_and_keeps_user_keys(machine, home, services):
    assert run("--yes").exit_code == 0
    p = home / "configs" / "nano-mtp.toml"
    p.write_text(p.read_text() + '\n[mine]\nnote = "keep me"\n')
    res = run("--yes")
    assert res.exit_code == 0, res.output
    assert [c[0] for c in services.calls].count("calibrate") == 1
    assert "already done" in res.output
    doc = tomllib.loads(p.read_text())
    assert doc["mine"] == {"note": "keep me"} and doc["speculative"]["source"] == "calibrated"
    assert not (home / "backups").exists()             # the rerun changed nothing: nothing to back up
    assert run("--yes", "--context", "2048").exit_code == 0                  # a rerun that changes the config
    assert tomllib.loads((home / "backups" / "nano-mtp.toml").read_text())["mine"] == {"note": "keep me"}
    assert sorted(x.name for x in p.parent.iterdir()) == ["nano-mtp.toml"]    # nothing left beside it


@pytest.mark.parametrize("quant", ["bf16", "q8_0", "q5_0", "q4_0"])
def test_dflash2_each_quant(machine, home, services, pack, quant):
    res = run("--yes", "--drafter", "dflash2", "--dflash2-quant", quant, "--dflash2-head", "turbo",
              "--no-calibrate", "--context", "512")
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "configs" / f"nano-dflash2-{quant}.toml").read_text())
    d = doc["drafter"]
    assert d["kind"] == "dflash2" and d["head"] == "turbo" and d["quantization"] == quant
    assert d["path"].endswith(f"-{quant}.gguf")
    geom = DFlash2Geometry.from_config(json.loads((pack["turbo"] / "config.json").read_text()))
    assert doc["memory"]["budget"]["drafter_weights"] == weight_bytes(geom, quant, float_bytes=2)
    assert doc["memory"]["budget"]["drafter_kv"] == geom.num_layers * 2 * geom.num_kv_heads * geom.head_dim * 2 * 512
    assert ("convert", ("turbo", quant)) in services.calls
    assert doc["speculative"]["source"] == "default" and doc["calibration"]["status"] == "uncalibrated"


def test_dflash2_flags_imply_dflash2_and_default_head(machine, home):
    res = run("--yes", "--dflash2-quant", "q4_0", "--no-calibrate")
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "configs" / "nano-dflash2-q4_0.toml").read_text())
    assert doc["drafter"]["head"] == "official"


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--drafter", "mtp", "--dflash2-quant", "q4_0"], ["--drafter mtp", "--dflash2"]),
        (["--drafter", "mtp", "--dflash2-head", "official"], ["--drafter mtp"]),
        (["--drafter", "none", "--dflash2-quant", "q8_0"], ["--drafter none"]),
        (["--dflash2-quant", "q3_k"], ["q3_k", "bf16, q8_0, q5_0 or q4_0"]),
        (["--drafter", "medusa"], ["medusa", "mtp, dflash2 or none"]),
        (["--context", "-5"], ["--context", "-5"]),
        (["--context", "0"], ["--context"]),
        (["--context", "100000"], ["limit of 4096"]),
        (["--vram-reserve-mib", "999999"], ["larger than", "16384 MiB"]),
        (["--vram-reserve-mib", "-1"], ["cannot be negative"]),
        (["--target", "nope"], ["Unknown target 'nope'", "nano"]),
        (["--target", "unpinned"], ["not pinned"]),
        (["--target", "big", "--offline"], ["--offline", "not downloaded"]),
        (["--drafter", "dflash2", "--dflash2-head", "nobody"], ["Unknown DFlash2 head", "official, turbo"]),
        (["--target", "/no/such/folder"], ["not a model folder"]),
    ],
)
def test_bad_flags_exit_2_with_one_sentence(machine, home, args, needles):
    res = run("--yes", *args)
    one_sentence_error(res, *needles)
    assert files_under(home) == []


def test_cpu_reserve_checked_against_ram(machine, home):
    machine["hw"] = fake_cpu(ram_gib=1)
    one_sentence_error(run("--yes", "--vram-reserve-mib", "2048"), "RAM", "1024 MiB")


def test_does_not_fit_exits_1(machine, home):
    machine["hw"] = fake_cpu(ram_gib=0.01)  # 10 MiB of RAM: the KV alone is larger
    res = run("--yes", "--context", "4096", "--vram-reserve-mib", "0")
    assert res.exit_code == 1, res.output
    assert "Does not fit" in res.output
    assert not (home / "configs").exists()


def test_dry_run_writes_nothing_and_json(machine, home, services):
    res = run("--yes", "--dry-run", "--json", "--drafter", "dflash2", "--dflash2-quant", "q8_0")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["dry_run"] is True
    plan = out["plan"]
    assert plan["drafter"] == "dflash2" and plan["dflash2_quant"] == "q8_0" and plan["dflash2_head"] == "official"
    assert any(s.startswith("convert official") for s in plan["steps"])
    assert plan["download_bytes"] == 1_000_000  # the head; the bundled target is here
    assert files_under(home) == [] and services.calls == []
    res = run("--yes", "--dry-run")
    assert res.exit_code == 0 and "Dry run" in res.output and files_under(home) == []


def test_json_run_prints_one_object(machine, home):
    res = CliRunner().invoke(app, ["--yes", "--json", "--no-calibrate", "--context", "256"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["config"].endswith("nano-mtp.toml") and out["run"].startswith("strata-run --config ")
    assert out["serve"] == f"strata-serve --config {out['config']}"
    assert out["budget"]["fits"] and out["budget"]["items"]["target_kv"] > 0


def test_answers_file_and_flags_win(machine, home, tmp_path):
    ans = tmp_path / "a.toml"
    ans.write_text('drafter = "dflash2"\ndflash2-quant = "q4_0"\ncontext = 1024\ncalibrate = false\n')
    res = run("--answers", str(ans), "--context", "2048")
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "configs" / "nano-dflash2-q4_0.toml").read_text())
    assert doc["drafter"]["quantization"] == "q4_0" and doc["memory"]["context"] == 2048
    ans.write_text('drafter = "dflash2"\ncolour = "blue"\n')
    one_sentence_error(run("--answers", str(ans)), "unknown key 'colour'")
    ans.write_text('context = "long"\n')
    one_sentence_error(run("--answers", str(ans)), "'context' must be int")


def test_config_out(machine, home, tmp_path):
    out = tmp_path / "elsewhere" / "my.toml"
    res = run("--yes", "--no-calibrate", "--config-out", str(out), "--drafter", "none")
    assert res.exit_code == 0, res.output
    doc = tomllib.loads(out.read_text())
    assert doc["drafter"] == {"kind": "none"} and doc["speculative"]["block"] == 1
    assert doc["memory"]["budget"]["drafter_weights"] == 0 and doc["memory"]["budget"]["drafter_kv"] == 0


@pytest.mark.parametrize("step", ["fetch", "convert", "calibrate"])
def test_ctrl_c_during_a_step_leaves_nothing_half_written(machine, home, services, step):
    services.interrupt_on = step
    res = run("--yes", "--drafter", "dflash2", "--dflash2-quant", "q8_0")
    assert res.exit_code == 130, res.output
    assert "nothing half-written" in res.output
    leftovers = [f for f in files_under(home) if f.endswith((".tmp", ".part"))]
    assert leftovers == []
    cfg = home / "configs" / "nano-dflash2-q8_0.toml"
    assert not cfg.exists()   # the config is written once, after calibration: a stopped run leaves none
    if step == "calibrate":   # a rerun calibrates and writes the calibrated config
        services.interrupt_on = None
        assert run("--yes", "--drafter", "dflash2", "--dflash2-quant", "q8_0").exit_code == 0
        assert tomllib.loads(cfg.read_text())["speculative"]["source"] == "calibrated"


def test_a_failed_calibration_leaves_no_config_and_keeps_the_old_one(machine, home, services, monkeypatch):
    """A calibration that fails writes nothing: no config on a first run, the previous config intact on a rerun."""
    from runtime.errors import WorkError

    def broken(doc, **kw):
        raise WorkError("calibration failed: the arm changed greedy output.")

    monkeypatch.setattr(services, "calibrate", broken)
    res = run("--yes", "--drafter", "dflash2", "--dflash2-quant", "q8_0")
    assert res.exit_code == 1 and "calibration failed" in res.output
    cfg = home / "configs" / "nano-dflash2-q8_0.toml"
    assert not cfg.exists()
    assert run("--yes", "--drafter", "dflash2", "--dflash2-quant", "q8_0", "--no-calibrate").exit_code == 0
    before = cfg.read_bytes()
    res = run("--yes", "--drafter", "dflash2", "--dflash2-quant", "q8_0", "--context", "512")
    assert res.exit_code == 1 and cfg.read_bytes() == before


def test_budget_and_calibrate_subcommands(machine, home, services):
    assert run("--yes", "--no-calibrate", "--context", "1024").exit_code == 0
    cfg = home / "configs" / "nano-mtp.toml"
    res = run("budget", "--config", str(cfg), "--json")
    assert res.exit_code == 0, res.output
    b = json.loads(res.stdout)
    assert b["items"] == tomllib.loads(cfg.read_text())["memory"]["budget"]
    res = run("budget", "--config", str(cfg))
    assert res.exit_code == 0 and "expert_cache" in res.output and "target_kv" in res.output
    res = run("calibrate", "--config", str(cfg), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["speculative"]["source"] == "calibrated"
    one_sentence_error(run("budget", "--config", str(home / "nope.toml")), "No config at")
    one_sentence_error(run("calibrate", "--config", str(cfg), "--max-seconds", "0"), "--max-seconds")


def test_stale_config_is_refused(machine, home, tmp_path, pack):
    import shutil

    local = tmp_path / "copy"
    shutil.copytree(pack["nano"], local)
    assert run("--yes", "--no-calibrate", "--target", str(local), "--context", "256").exit_code == 0
    cfg = home / "configs" / "copy-mtp.toml"
    with open(local / "model.safetensors", "ab") as f:
        f.write(b"\0")
    one_sentence_error(run("budget", "--config", str(cfg)), "stale", "changed size")


def test_unexpected_error_is_one_sentence_and_debug_shows_it(machine, home, services, monkeypatch):
    def boom():
        raise RuntimeError("catalog exploded")

    monkeypatch.setattr(services, "targets", boom)
    res = run("--yes")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "catalog exploded" in res.output and "--debug" in res.output
    res = run("--yes", "--debug")
    assert isinstance(res.exception, RuntimeError)


def test_budget_follows_the_configs_device_and_dtype(machine, home):
    import tomli_w

    assert run("--yes", "--no-calibrate", "--context", "512").exit_code == 0  # written on the (fake) GPU: bf16
    cfg = home / "configs" / "nano-mtp.toml"
    gpu = json.loads(run("budget", "--config", str(cfg), "--json").stdout)
    doc = tomllib.loads(cfg.read_text())
    doc["memory"]["kv_dtype"] = "fp32"  # a user's edit: wider KV
    cfg.write_text(tomli_w.dumps(doc))
    wide = json.loads(run("budget", "--config", str(cfg), "--json").stdout)
    assert wide["items"]["target_kv"] == 2 * gpu["items"]["target_kv"]
    assert wide["items"]["target_dense_weights"] == gpu["items"]["target_dense_weights"]
    machine["hw"] = fake_cpu()
    res = run("budget", "--config", str(cfg))
    assert res.exit_code == 2 and "no" in res.output and "CUDA" in res.output


def test_threads_reach_the_services_that_calibrate(machine, home, services, monkeypatch):
    """`--threads N` goes to the services (calibration runs with it); a bad value is one sentence, exit 2."""
    from setup_wizard import cli

    seen = []
    monkeypatch.setattr(cli, "get_services", lambda *a: (seen.append(a[1:]), services)[1])
    res = run("--yes", "--threads", "2", "--context", "256")
    assert res.exit_code == 0, res.output
    assert seen == [(2,)]
    one_sentence_error(run("--yes", "--threads", "0"), "--threads must be >= 1")
    cfg = next((home / "configs").glob("*.toml"))
    seen.clear()
    res = run("calibrate", "--config", str(cfg), "--threads", "3", "--force")
    assert res.exit_code == 0, res.output
    assert seen == [(3,)]
    one_sentence_error(run("calibrate", "--config", str(cfg), "--threads", "0"), "--threads must be >= 1")


def test_a_second_setup_with_another_quantization_gets_its_own_config(machine, home):
    """Config names carry the quantization: setting up Q4_0 after Q8_0 keeps both configs."""
    for quant in ("q8_0", "q4_0"):
        assert run("--yes", "--dflash2-quant", quant, "--no-calibrate", "--context", "512").exit_code == 0
    names = sorted(p.name for p in (home / "configs").iterdir())
    assert names == ["nano-dflash2-q4_0.toml", "nano-dflash2-q8_0.toml"]
    for quant in ("q8_0", "q4_0"):
        doc = tomllib.loads((home / "configs" / f"nano-dflash2-{quant}.toml").read_text())
        assert doc["drafter"]["quantization"] == quant


@pytest.mark.parametrize("cpu, compile_on, drafter, listed", [
    (True, "1", "mtp", "compile the target's steps and the MTP drafter's for this CPU (once per machine; reused after)"),
    (True, "1", "dflash2", "compile the target's steps for this CPU (once per machine; reused after)"),
    (True, "1", "none", "compile the target's steps for this CPU (once per machine; reused after)"),
    (True, "0", "mtp", None), (False, "1", "mtp", None)])
def test_dry_run_lists_the_compile_step_for_a_cpu_setup(machine, home, services, monkeypatch, cpu, compile_on,
                                                         drafter, listed):
    if cpu:
        machine["hw"] = fake_cpu()
    monkeypatch.setenv("STRATA_COMPILE", compile_on)
    res = run("--yes", "--dry-run", "--json", "--drafter", drafter)
    assert res.exit_code == 0, res.output
    steps = json.loads(res.stdout)["plan"]["steps"]
    compiling = [s for s in steps if s.startswith("compile ")]
    assert compiling == ([listed] if listed else [])
    assert files_under(home) == [] and services.calls == []


@pytest.mark.parametrize("drafter", ["mtp", "none"])
def test_a_cpu_setup_compiles_its_steps_before_calibrating(machine, home, services, monkeypatch, drafter):
    """On a CPU with compiling on, setup builds the compiled steps (services.compile_steps) before it calibrates,
    with or without a drafter; the JSON step list says so."""
    machine["hw"] = fake_cpu()
    monkeypatch.setenv("STRATA_COMPILE", "1")
    res = run("--yes", "--json", "--drafter", drafter, "--context", "256")
    assert res.exit_code == 0, res.output
    order = [c[0] for c in services.calls if c[0] in ("compile_steps", "calibrate")]
    assert order == (["compile_steps", "calibrate"] if drafter == "mtp" else ["compile_steps"])
    steps = {s["step"]: s for s in json.loads(res.stdout)["steps"]}
    name = next(s for s in steps if s.startswith("compile "))
    assert steps[name]["status"] == "done"


def test_a_target_too_large_to_pack_skips_the_compile_step_with_the_reason(machine, home, services, monkeypatch):
    from runtime import target_compiled
    from setup_wizard.inspection import target_geometry

    machine["hw"] = fake_cpu()
    monkeypatch.setenv("STRATA_COMPILE", "1")
    monkeypatch.setattr("runtime.models.layers.DENSE_EXPERT_BYTES", 1)
    assert target_compiled.may_fit(target_geometry(services.pack["nano"])) \
        == "the target's experts are too large to pack for the compiled step"
    res = run("--yes", "--json", "--drafter", "none", "--context", "256")
    assert res.exit_code == 0, res.output
    assert "compile_steps" not in [c[0] for c in services.calls]
    step = next(s for s in json.loads(res.stdout)["steps"] if s["step"].startswith("compile "))
    assert step["status"] == "skipped" and "too large to pack" in step["reason"]
