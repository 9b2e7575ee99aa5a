"""`strata-setup models add ORG/NAME --file F.gguf` against the loopback Hub: one llama.cpp GGUF file pinned as a
target from its LFS sha256, checked from its header (ranged requests, no weights) as strata-run will load it, then
pulled (hashed while it streams), set up as stored and run; the files it refuses, each in one sentence."""

from __future__ import annotations

import hashlib
import json
import tomllib

import pytest
from typer.testing import CliRunner

from runtime.loading_gguf import read_target_config
from setup_wizard import cli, gguf_remote
from tests.runtime.drafters.dflash2.helpers import drafter_config, write_hf_drafter
from tests.setup_wizard.target_gguf_helpers import llamacpp_block_gguf
from tests.setup_wizard.wizard_fakes import fake_cpu

FILE = "Mini-MoE-Q5_K_M.gguf"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A llama.cpp-style Q5_K_M file of a tiny random qwen3moe target, one with an IQ3_XXS tensor (a type Strata
    does not read), and a DFlash2 head of the target's shape."""
    root = tmp_path_factory.mktemp("gguf-hub")
    gg, _, _ = llamacpp_block_gguf(root / "a", "Q5_K")
    bad, _, _ = llamacpp_block_gguf(root / "b", "Q4_K", lambda n: "IQ3_XXS" if n == "blk.1.attn_q.weight" else "Q4_K")
    c = read_target_config(gg)
    head = write_hf_drafter(root / "head", drafter_config(hidden=c.hidden_size, vocab=c.vocab_size, taps=(0, 1),
                                                          block_size=4, head_dim=64), seed=3)
    return {"gguf": gg.read_bytes(), "path": gg, "iq3": bad.read_bytes(),
            "head": {p.name: p.read_bytes() for p in head.iterdir() if p.is_file()}}


@pytest.fixture
def env(hub, home, monkeypatch):
    monkeypatch.setattr(cli, "get_hardware", lambda: fake_cpu(ram_gib=8))
    monkeypatch.setattr(cli, "is_interactive", lambda: False)
    monkeypatch.setattr(gguf_remote, "FIRST_READ", 4096)     # the header is read in growing ranges
    return hub


def run(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def words(res) -> str:
    return " ".join(res.output.split())


def generate(cfg, *extra: str, n: int = 8) -> list[int]:
    from runtime.cli import app as run_app

    out = CliRunner().invoke(run_app, ["--config", str(cfg), "--prompt", "Hello", "--max-new-tokens", str(n),
                                       "--json", *extra])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)["token_ids"]


def test_gguf_file_pinned_from_its_header_pulled_set_up_and_run(env, home, files, tmp_path):
    hub = env
    data = files["gguf"]
    commit = hub.publish("t/Mini-MoE-GGUF", {FILE: data, "Mini-MoE-Q4_K_M.gguf": files["iq3"], "README.md": b"# m"})
    res = run("models", "add", "t/Mini-MoE-GGUF")           # which file? one sentence, naming them
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "pass --file with the one to pin as the target, like --file Mini-MoE-Q4_K_M.gguf" in words(res)

    res = run("models", "add", "t/Mini-MoE-GGUF", "--file", FILE, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["name"] == "mini-moe-q5_k_m" and doc["kind"] == "target" and doc["revision"] == commit
    assert doc["quant"] == "q5_k" and doc["mtp"] is False and doc["drafters"] == ["dflash2", "none"]
    assert [(f["path"], f["sha256"], f["size"]) for f in doc["files"]] == [
        (FILE, hashlib.sha256(data).hexdigest(), len(data))]
    # only the header moved: ranged requests that grew from the first read and ended well before the weights
    ranges = hub.gets(FILE)
    assert len(ranges) >= 2 and None not in ranges
    last = max(int(r.split("-")[1]) for r in ranges)
    assert last < len(data) // 2
    entry = tomllib.loads((home / "catalog.toml").read_text())["entry"][0]
    assert entry["quant"] == "q5_k" and entry["mtp"] is False and len(entry["file"]) == 1

    # before the download the plan runs the file as stored (no size question, no conversion), budgeted exactly from
    # its header on the Hub: the context recommended for this machine, the budget setup writes after the download
    res = run("--yes", "--target", "mini-moe-q5_k_m", "--drafter", "none", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert plan["target_quant"] == "q5_k" and not any("convert" in s for s in plan["steps"])
    assert plan["budget"]["fits"] and plan["why"]["context"] != "a safe default until the model's size is known"
    res = run("--yes", "--target", "mini-moe-q5_k_m", "--drafter", "none", "--context", "256", "--dry-run", "--json")
    before = json.loads(res.stdout)["plan"]["budget"]["items"]
    assert not (home / "downloads" / "t--Mini-MoE-GGUF").exists()      # nothing was downloaded
    res = run("--yes", "--target", "mini-moe-q5_k_m", "--target-quant", "q4_0", "--dry-run")
    assert res.exit_code == 2 and "stored as q5_k; drop --target-quant." in words(res)

    res = run("models", "pull", "mini-moe-q5_k_m")
    assert res.exit_code == 0 and "downloaded and verified" in res.output, res.output
    assert (home / "downloads" / "t--Mini-MoE-GGUF" / commit / FILE).read_bytes() == data
    res = run("--yes", "--target", "mini-moe-q5_k_m", "--drafter", "none", "--no-calibrate", "--context", "256")
    assert res.exit_code == 0, res.output
    cfg = home / "configs" / "mini-moe-q5_k_m-q5_k-none.toml"
    assert tomllib.loads(cfg.read_text())["memory"]["budget"] == before
    conf = tomllib.loads(cfg.read_text())["target"]
    assert conf["path"].endswith(f"/{commit}/{FILE}") and conf["quantization"] == "q5_k"
    assert conf["sha256"] == hashlib.sha256(data).hexdigest() and conf["revision"] == commit
    # the same tokens as the same file given as a local --target
    res = run("--yes", "--target", str(files["path"]), "--drafter", "none", "--no-calibrate", "--context", "256",
              "--config-out", str(tmp_path / "local.toml"))
    assert res.exit_code == 0, res.output
    assert generate(cfg) == generate(tmp_path / "local.toml")


def test_a_head_added_after_the_gguf_target_fits_it_and_drafts(env, home, files):
    hub = env
    hub.publish("t/Mini-MoE-GGUF", {FILE: files["gguf"]})
    hub.publish("t/mini-head", files["head"])
    assert run("models", "add", "t/Mini-MoE-GGUF", "--file", FILE).exit_code == 0
    before = len(hub.gets(FILE))
    res = run("models", "add", "t/mini-head")       # the target's shape from its header on the Hub (not pulled)
    assert res.exit_code == 0, res.output
    assert "fits:      mini-moe-q5_k_m" in res.output and len(hub.gets(FILE)) > before
    res = run("--yes", "--target", "mini-moe-q5_k_m", "--no-calibrate", "--context", "256", "--dflash2-quant", "bf16")
    assert res.exit_code == 0, res.output
    cfg = home / "configs" / "mini-moe-q5_k_m-q5_k-dflash2-bf16.toml"
    assert tomllib.loads(cfg.read_text())["drafter"]["head"] == "mini-head"
    assert generate(cfg) == generate(cfg, "--no-draft")          # greedy: lossless against the GGUF target


def test_gguf_files_refused_in_one_sentence(env, home, files):
    hub = env
    hub.publish("t/odd-GGUF", {FILE: files["gguf"], "Mini-MoE-IQ3.gguf": files["iq3"], "notes.txt": b"x",
                               "junk.gguf": b"GGUF" + b"\0" * 60, "empty.gguf": b"", "Big-00001-of-00003.gguf": b"GGUF",
                               "Big-00002-of-00003.gguf": b"x"})
    cases = {
        "Mini-MoE-IQ3.gguf": "Mini-MoE-IQ3.gguf of t/odd-GGUF at main cannot be run: tensor blk.1.attn_q.weight "
                             "is stored as IQ3_XXS, which Strata does not read",
        "junk.gguf": "junk.gguf of t/odd-GGUF at main is GGUF version 0; Strata reads versions 2 and 3.",
        "empty.gguf": "empty.gguf of t/odd-GGUF at main has 0 bytes, fewer than a GGUF header's first fields",
        "Big-00002-of-00003.gguf": "Big-00002-of-00003.gguf of t/odd-GGUF at main is a part of a GGUF file split "
                                   "in 3, and the repository lacks Big-00003-of-00003.gguf; choose a file whose parts "
                                   "are all there.",
        "missing.gguf": "t/odd-GGUF at main has no file missing.gguf; its GGUF files: Mini-MoE-IQ3.gguf, "
                        f"{FILE}, empty.gguf, junk.gguf.",
        "notes.txt": "--file notes.txt is not a .gguf file at the top of t/odd-GGUF at main",
        "../x.gguf": "escapes or is not a clean path",
    }
    for name, sentence in cases.items():
        res = run("models", "add", "t/odd-GGUF", "--file", name)
        assert res.exit_code == 2 and "Traceback" not in res.output, (name, res.output)
        assert sentence in words(res), (name, res.output)
    assert not (home / "catalog.toml").exists()      # nothing was pinned
    res = run("models", "add", "t/odd-GGUF", "--file", FILE, "--kind", "dflash2")
    assert res.exit_code == 2 and "drop --kind dflash2" in words(res)
    hub.publish("t/split-GGUF", {"Big-00001-of-00002.gguf": b"GGUF", "Big-00002-of-00002.gguf": b"x"})
    res = run("models", "add", "t/split-GGUF")     # a split file is offered by its first part
    assert res.exit_code == 2 and "holds GGUF files (Big-00001-of-00002.gguf) and no config.json" in words(res)


def test_split_gguf_pinned_part_by_part_pulled_and_run(env, home, files, tmp_path):
    """A GGUF file published in parts (llama.cpp's `-00001-of-0000N` names): any part named pins every part (each
    from its own LFS sha256), the entry named by the series; each part's header is checked before anything is
    downloaded; pulled, set up and run, it gives the tokens of the same parts given as a local --target (named by
    the first part)."""
    hub = env
    first, _, _ = llamacpp_block_gguf(tmp_path / "split", "Q5_K", split_max_tensors=12)
    parts = sorted(p for p in first.parent.glob("q5_k_m-*.gguf"))
    assert len(parts) >= 2 and parts[0] == first
    commit = hub.publish("t/Split-GGUF", {p.name: p.read_bytes() for p in parts})
    res = run("models", "add", "t/Split-GGUF", "--file", parts[1].name, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["name"] == "q5_k_m" and doc["quant"] == "q5_k"
    assert [(f["path"], f["sha256"], f["size"]) for f in doc["files"]] == [
        (p.name, hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_size) for p in parts]
    for p in parts:                  # every part's header read by ranges, none whole
        got = hub.gets(p.name)
        assert got and None not in got
    res = run("--yes", "--target", "q5_k_m", "--drafter", "none", "--context", "256", "--dry-run", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["plan"]["budget"]["fits"], res.output
    res = run("--yes", "--target", "q5_k_m", "--drafter", "none", "--no-calibrate", "--context", "256")
    assert res.exit_code == 0, res.output
    for p in parts:
        assert (home / "downloads" / "t--Split-GGUF" / commit / p.name).read_bytes() == p.read_bytes()
    cfg = home / "configs" / "q5_k_m-q5_k-none.toml"
    assert tomllib.loads(cfg.read_text())["target"]["path"].endswith(f"/{commit}/{first.name}")
    res = run("--yes", "--target", str(first), "--drafter", "none", "--no-calibrate", "--context", "256",
              "--config-out", str(tmp_path / "local.toml"))
    assert res.exit_code == 0, res.output
    assert tomllib.loads((tmp_path / "local.toml").read_text())["target"]["sha256"] == \
        tomllib.loads(cfg.read_text())["target"]["sha256"]
    assert generate(cfg) == generate(tmp_path / "local.toml")
    res = run("--yes", "--target", str(parts[1]), "--drafter", "none", "--dry-run")     # not the first part
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"is part 2 of a split GGUF file; give its first part, {first.name}." in words(res)


def test_wizard_asks_which_gguf_file_of_a_typed_repository(env, home, files):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from setup_wizard.choices import Choices

    hub = env
    hub.publish("t/Mini-MoE-GGUF", {"Mini-MoE-IQ3.gguf": files["iq3"], FILE: files["gguf"]})
    up, down, enter = "\x1b[A", "\x1b[B", "\r"
    # the last item of the target list: a repository typed in; its GGUF files (the second); "add it?"; "go ahead?"
    with create_pipe_input() as inp:
        inp.send_text(up + enter + "t/Mini-MoE-GGUF" + enter + down + enter + enter + enter)
        code = cli.run_setup(Choices(drafter="none", context=256, vram_reserve_mib=0, calibrate=False),
                             interactive=True, dry_run=False, json_out=False, input=inp, output=DummyOutput())
    assert code == 0
    conf = tomllib.loads((home / "configs" / "mini-moe-q5_k_m-q5_k-none.toml").read_text())
    assert conf["target"]["sha256"] == hashlib.sha256(files["gguf"]).hexdigest()
    assert conf["target"]["quantization"] == "q5_k"


def test_headers_that_are_not_a_qwen3moe_file(env, home, files, tmp_path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = files["gguf"]
    hub = env
    hub.publish("t/other-GGUF", {"llama.gguf": (tmp_path / "llama.gguf").read_bytes(), "cut-header.gguf": data[:5000],
                                 "cut-weights.gguf": data[:len(data) * 9 // 10]})
    cases = {"llama.gguf": "llama.gguf of t/other-GGUF at main cannot be run: llama.gguf holds a 'llama' model; "
                           "Strata runs qwen3moe (Qwen3-MoE) targets only.",
             "cut-header.gguf": "cut-header.gguf of t/other-GGUF at main is not a readable GGUF file",
             "cut-weights.gguf": "cut-weights.gguf of t/other-GGUF at main is not a readable GGUF file"}
    for name, sentence in cases.items():
        res = run("models", "add", "t/other-GGUF", "--file", name)
        assert res.exit_code == 2 and "Traceback" not in res.output, (name, res.output)
        assert sentence in words(res), (name, res.output)


def test_header_read_through_a_private_repository_and_a_server_without_ranges(env, home, files, monkeypatch):
    """The token goes with the header's ranged reads (a private repository); a server that answers every GET with
    the whole file still gives the header (only what is needed is read), and the pin is the same."""
    hub = env
    hub.publish("t/private-GGUF", {FILE: files["gguf"]})
    hub.private["t/private-GGUF"] = "hf_good"
    res = run("models", "add", "t/private-GGUF", "--file", FILE)
    assert res.exit_code == 1 and "set HF_TOKEN" in words(res), res.output
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    assert run("models", "add", "t/private-GGUF", "--file", FILE, "--name", "a").exit_code == 0
    hub.ignore_range = True
    res = run("models", "add", "t/private-GGUF", "--file", FILE, "--name", "b", "--json")
    assert res.exit_code == 0, res.output
    pins = {e["name"]: e["file"] for e in tomllib.loads((home / "catalog.toml").read_text())["entry"]}
    assert pins["a"] == pins["b"] == [{"path": FILE, "sha256": hashlib.sha256(files["gguf"]).hexdigest(),
                                       "size": len(files["gguf"])}]
