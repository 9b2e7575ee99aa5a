"""`strata-setup models add` against the loopback Hub: pins taken from the Hub's own metadata (a branch or tag
resolved to its commit, LFS sha256), header checks before any weight moves, then pull, setup and strata-run on the
pinned entries; a change on the Hub after the pin, refused access, untrusted file names and name collisions."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from setup_wizard import cli
from tests.runtime.drafters.dflash2.helpers import drafter_config, one_thread, write_hf_drafter  # noqa: F401
from tests.runtime.tiny import make_tiny_target
from tests.setup_wizard.wizard_fakes import fake_cpu

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny qwen3_moe target without an MTP head (sharded, and its single-file twin: the same weights), a DFlash2
    head and a DFlash v1 head that fit it."""
    root = tmp_path_factory.mktemp("models")
    shape = {"hidden": 64, "vocab": 80, "layers": 3, "mtp": False, "seed": 5}
    sharded = make_tiny_target(root, "sharded", sharded=True, **shape)
    single = make_tiny_target(root, "single", **shape)
    cfg = drafter_config(hidden=64, vocab=80, taps=(0, 2), block_size=4)
    head = write_hf_drafter(root / "head", cfg, seed=1)
    v1_cfg = {**cfg, "architectures": ["DFlashDraftModel"]}
    v1 = write_hf_drafter(root / "v1", v1_cfg, seed=2, v1=True)
    return {"sharded": _files(sharded), "single": _files(single), "head": _files(head), "v1": _files(v1)}


@pytest.fixture
def env(hub, home, monkeypatch):
    monkeypatch.setattr(cli, "get_hardware", lambda: fake_cpu(ram_gib=8))
    monkeypatch.setattr(cli, "is_interactive", lambda: False)
    return hub


def run(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def add(*args: str) -> dict:
    res = run("models", "add", *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def generate(cfg: Path, *extra: str, n: int = 10, drafter: str = "none") -> list[int]:
    from runtime.cli import app as run_app

    out = CliRunner().invoke(run_app, ["--config", str(cfg), "--prompt", "Hello", "--max-new-tokens", str(n),
                                       "--json", *extra])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["stats"]["generated_tokens"] == n
    assert data["stats"]["drafter"] == ("none" if "--no-draft" in extra else drafter)
    return data["token_ids"]


def test_add_by_branch_and_tag_then_pull_set_up_and_run(env, home, models):
    hub = env
    junk = {"modeling_qwen3_moe.py": b"import os\n", "pytorch_model.bin": b"\x80\x04pickle", "README.md": b"# hi"}
    commit = hub.publish("t/Tiny-MoE", {**models["sharded"], **junk})
    head_commit = hub.publish("t/tiny-head", models["head"], ref="v1.0")
    doc = add("t/Tiny-MoE")        # no --revision: the main branch, resolved to its commit
    assert doc["revision"] == commit and doc["ref"] == "main" and doc["name"] == "tiny-moe"
    assert doc["kind"] == "target" and doc["mtp"] is False and doc["drafters"] == ["dflash2", "none"]
    assert any("blobs=true" in c for c in hub.api_calls)
    # exactly the files the runtime needs, each pinned by the sha256 of its bytes on the Hub (never code, pickles)
    want = {n: models["sharded"][n] for n in ("config.json", "tokenizer.json", "model.safetensors.index.json",
                                              *SHARDS)}
    assert {f["path"]: (f["sha256"], f["size"]) for f in doc["files"]} == {
        n: (hashlib.sha256(b).hexdigest(), len(b)) for n, b in want.items()}
    for shard in SHARDS:          # the weights were not downloaded: their headers were read with ranged requests
        assert hub.gets(shard) and None not in hub.gets(shard)
    entry = tomllib.loads((home / "catalog.toml").read_text())["entry"][0]
    assert entry["revision"] == commit and entry["source"] == "hf" and entry["mtp"] is False

    res = run("models", "add", "t/tiny-head", "--revision", "v1.0")        # a tag, in words this time
    assert res.exit_code == 0, res.output
    assert f"v1.0 = commit {head_commit}" in res.output and "fits:      tiny-moe" in res.output
    heads = {e["name"]: e for e in tomllib.loads((home / "catalog.toml").read_text())["entry"]}
    assert heads["tiny-head"]["fits"] == ["tiny-moe"] and heads["tiny-head"]["kind"] == "dflash2"

    for name in ("tiny-moe", "tiny-head"):
        res = run("models", "pull", name)
        assert res.exit_code == 0 and "downloaded and verified" in res.output, res.output
    d = home / "downloads" / "t--Tiny-MoE" / commit
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == sorted(want)

    # setup picks DFlash2 (no MTP head; a head fits), reuses the verified downloads, and strata-run generates
    res = run("--yes", "--target", "tiny-moe", "--target-quant", "bf16", "--no-calibrate", "--context", "128",
              "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert plan["drafter"] == "dflash2" and plan["why"]["drafter"] == "the target has no MTP head; a DFlash2 head fits it"
    cfg = home / "configs" / "tiny-moe-dflash2-bf16.toml"
    conf = tomllib.loads(cfg.read_text())
    assert conf["target"]["revision"] == commit and conf["drafter"]["head"] == "tiny-head"
    assert generate(cfg, drafter="dflash2") == generate(cfg, "--no-draft")    # greedy: the same tokens


def test_sharded_target_generates_the_same_tokens_as_its_single_file_twin(env, home, models):
    hub = env
    hub.publish("t/twin-sharded", models["sharded"])
    hub.publish("t/twin-single", models["single"])
    tokens, budgets = {}, {}
    for name in ("twin-sharded", "twin-single"):
        add(f"t/{name}")
        res = run("--yes", "--target", name, "--drafter", "none", "--no-calibrate", "--context", "128")
        assert res.exit_code == 0, res.output
        cfg = home / "configs" / f"{name}-none.toml"
        budgets[name] = tomllib.loads(cfg.read_text())["memory"]["budget"]
        tokens[name] = generate(cfg, n=12)
    assert tokens["twin-sharded"] == tokens["twin-single"]
    assert budgets["twin-sharded"] == budgets["twin-single"]       # the budget reads the shards through the index


def test_a_change_on_the_hub_after_add_is_refused_at_pull(env, home, models):
    hub = env
    commit = hub.publish("t/moe", models["single"])
    add("t/moe")
    hub.publish("t/moe", {**models["single"], "config.json": b"{}"})        # main moves on: the pin does not
    # the bytes behind the pinned commit change (a rewritten history): same size, other bytes
    data = bytearray(models["single"]["model.safetensors"])
    data[-1] ^= 0xFF
    hub.repos["t/moe"][commit]["model.safetensors"] = bytes(data)
    res = run("models", "pull", "moe")
    assert res.exit_code == 1, res.output
    out = " ".join(res.output.split())
    assert "model.safetensors" in out and hashlib.sha256(data).hexdigest() in out and "Traceback" not in out
    assert not (home / "downloads" / "t--moe" / commit / "model.safetensors").exists()
    # another size: refused before a byte of it is fetched
    hub.repos["t/moe"][commit]["model.safetensors"] = bytes(data) + b"\0"
    res = run("models", "pull", "moe")
    assert res.exit_code == 1 and "catalog pins" in " ".join(res.output.split()), res.output
    # restored: the pinned commit's bytes, not main's
    hub.repos["t/moe"][commit]["model.safetensors"] = models["single"]["model.safetensors"]
    assert run("models", "pull", "moe").exit_code == 0
    assert (home / "downloads" / "t--moe" / commit / "config.json").read_bytes() == models["single"]["config.json"]


def test_refused_access_says_set_hf_token(env, home, models, monkeypatch):
    hub = env
    hub.publish("t/private", models["single"])
    hub.private["t/private"] = "hf_good"
    res = run("models", "add", "t/private")
    assert res.exit_code == 1, res.output
    out = " ".join(res.output.split())
    assert "401" in out and "set HF_TOKEN" in out and "Traceback" not in out
    monkeypatch.setenv("HF_TOKEN", "hf_bad")
    res = run("models", "add", "t/private")
    assert res.exit_code == 1 and "refused HF_TOKEN" in " ".join(res.output.split()), res.output
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    add("t/private")
    assert [a for p, a in hub.auth if p.startswith("/cdn/")] and all(a is None for p, a in hub.auth
                                                                     if p.startswith("/cdn/"))   # never to a CDN
    monkeypatch.delenv("HF_TOKEN")          # the pinned entry needs the token at pull time too
    res = run("models", "pull", "private")
    assert res.exit_code == 1 and "set HF_TOKEN" in " ".join(res.output.split()), res.output
    # gated: the metadata is public, the files are not
    hub.publish("t/gated", models["single"])
    hub.gated["t/gated"] = "hf_accepted"
    res = run("models", "add", "t/gated")
    assert res.exit_code == 1 and "gated" in res.output and "HF_TOKEN" in res.output, res.output
    # what does not exist is bad input (exit 2), not an access problem
    res = run("models", "add", "t/nothing-here")
    assert res.exit_code == 2 and "no model repository t/nothing-here" in " ".join(res.output.split())
    res = run("models", "add", "t/gated", "--revision", "no-such-branch")
    assert res.exit_code == 2 and "no branch, tag or commit 'no-such-branch'" in " ".join(res.output.split())
    assert not (home / "catalog.toml").read_text().count("t/gated")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../x.safetensors", "/etc/x.safetensors",
                                   "model.bin"])
def test_untrusted_file_names_from_the_hub_are_refused(env, home, models, shard):
    hub = env
    files = dict(models["sharded"])
    index = json.loads(files["model.safetensors.index.json"])
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files[shard.lstrip("/")] = b"x"
    hub.publish("t/evil", files)
    res = run("models", "add", "t/evil")
    assert res.exit_code == 2, res.output
    assert "refusing it" in res.output and "Traceback" not in res.output
    assert not (home / "catalog.toml").exists() and not (home / "downloads").exists()


def test_pickles_only_and_a_catalog_path_outside_the_repository(env, home, models, tmp_path, monkeypatch):
    hub = env
    hub.publish("t/pickled", {"config.json": models["single"]["config.json"], "pytorch_model.bin": b"\x80"})
    res = run("models", "add", "t/pickled")
    assert res.exit_code == 2 and "pickle weights only" in res.output, res.output
    # a llama.cpp repository (GGUF files, no config.json) without --file: which file to pin, naming them
    hub.publish("t/m-GGUF", {"m-Q4_K_M.gguf": b"GGUF", "m-Q5_K_M.gguf": b"GGUF", "README.md": b"# m"})
    res = run("models", "add", "t/m-GGUF")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "holds GGUF files (m-Q4_K_M.gguf, m-Q5_K_M.gguf)" in " ".join(res.output.split())
    assert "pass --file with the one to pin as the target, like --file m-Q4_K_M.gguf" in " ".join(res.output.split())
    assert not (home / "catalog.toml").exists()
    # a catalog file is untrusted too: a pinned path that leaves the repository is refused when it is read
    (home / "catalog.toml").parent.mkdir(parents=True, exist_ok=True)
    (home / "catalog.toml").write_text(
        '[[entry]]\nname = "x"\nkind = "target"\nsource = "hf"\nrepo = "t/x"\nrevision = "' + "a" * 40 + '"\n'
        '[[entry.file]]\npath = "../../etc/passwd"\nsha256 = "' + "0" * 64 + '"\nsize = 1\n')
    res = run("models", "pull", "x")
    assert res.exit_code == 2 and "escapes" in res.output, res.output


def test_names_kinds_and_fits(env, home, models):
    hub = env
    hub.publish("x/strata-nano", models["single"])
    res = run("models", "add", "x/strata-nano")
    assert res.exit_code == 2 and "pass --name" in res.output, res.output          # a shipped pinned entry
    assert run("models", "add", "x/strata-nano", "--name", "strata-nano").exit_code == 2
    assert add("x/strata-nano", "--name", "my-nano")["name"] == "my-nano"
    # a shipped suggestion is pinned under its own name (the wizard's "pin it from the Hub now")
    commit = hub.publish("Qwen/Qwen3-30B-A3B", models["single"])
    assert add("Qwen/Qwen3-30B-A3B")["name"] == "qwen3-30b-a3b"
    rows = {r["name"]: r for r in json.loads(run("models", "list", "--json").stdout)["models"]}
    assert rows["qwen3-30b-a3b"]["pinned"] and rows["qwen3-30b-a3b"]["revision"] == commit
    # kinds: a head is not a target; a v1 head is a `dflash` entry
    hub.publish("t/head-v1", models["v1"])
    res = run("models", "add", "t/head-v1", "--kind", "target")
    assert res.exit_code == 2 and "not a target" in res.output
    res = run("models", "add", "t/head-v1", "--kind", "dflash2")
    assert res.exit_code == 2 and "pass --kind dflash" in " ".join(res.output.split())
    doc = add("t/head-v1", "--kind", "dflash")
    assert doc["kind"] == "dflash" and set(doc["fits"]) == {"my-nano", "qwen3-30b-a3b"}
    # a target added later is listed in the fits of your catalog's heads that fit it
    hub.publish("t/later", models["sharded"])
    assert add("t/later")["heads"] == ["head-v1"]
    entries = {e["name"]: e for e in tomllib.loads((home / "catalog.toml").read_text())["entry"]}
    assert entries["head-v1"]["fits"] == ["later", "my-nano", "qwen3-30b-a3b"]
    # a head for a shape no catalog target has
    hub.publish("t/head-wide", _files(write_hf_drafter(Path(home.parent / "wide"),
                                                       drafter_config(hidden=96, vocab=80, taps=(0, 2)), seed=3)))
    res = run("models", "add", "t/head-wide")
    assert res.exit_code == 2 and "no target in your catalog has that shape" in " ".join(res.output.split())


def test_sharded_head_is_header_checked_and_pulled(env, home, models, tmp_path):
    from safetensors.torch import load_file, save_file

    hub = env
    src = tmp_path / "src.safetensors"
    src.write_bytes(models["head"]["model.safetensors"])
    state = load_file(str(src))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    files = {"config.json": models["head"]["config.json"]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / shard))
        files[shard] = (tmp_path / shard).read_bytes()
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}).encode()
    hub.publish("t/moe", models["single"])
    hub.publish("t/sharded-head", files)
    add("t/moe")
    doc = add("t/sharded-head")
    assert [f["path"] for f in doc["files"]] == ["config.json", "model.safetensors.index.json", *shards]
    res = run("models", "pull", "sharded-head")
    assert res.exit_code == 0, res.output
    for shard in shards:       # the pull read both headers with ranged requests before fetching the weights
        gets = hub.gets(shard)
        assert gets.index(None) > 0 and all(g is not None for g in gets[:gets.index(None)])


def test_v1_head_pulls_converts_and_drafts(env, home, models):
    hub = env
    hub.publish("t/moe", models["single"])
    hub.publish("t/v1-head", models["v1"])
    add("t/moe")
    assert add("t/v1-head")["kind"] == "dflash"
    res = run("--yes", "--target", "moe", "--dflash2-head", "v1-head", "--dflash2-quant", "q8_0", "--no-calibrate",
              "--context", "128")
    assert res.exit_code == 0, res.output
    cfg = home / "configs" / "moe-dflash2-q8_0.toml"
    assert tomllib.loads(cfg.read_text())["drafter"]["head"] == "v1-head"
    assert generate(cfg, n=6, drafter="dflash2") == generate(cfg, "--no-draft", n=6)


def test_wizard_adds_a_typed_repository_and_a_suggestion(env, home, models):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from setup_wizard.choices import Choices

    hub = env
    hub.publish("t/typed-moe", models["single"])
    hub.publish("Qwen/Qwen3-Coder-30B-A3B-Instruct", models["single"])
    up, down, enter = "\x1b[A", "\x1b[B", "\r"

    def drive(keys: str, **choices) -> int:
        ch = {"drafter": "none", "context": 128, "vram_reserve_mib": 0, "calibrate": False, "target_quant": "bf16",
              **choices}
        with create_pipe_input() as inp:
            inp.send_text(keys)
            return cli.run_setup(Choices(**ch), interactive=True, dry_run=False, json_out=False, input=inp,
                                 output=DummyOutput())

    # the last item of the target list: a repository typed in; then "add it?" and "go ahead?"
    assert drive(up + enter + "t/typed-moe" + enter + enter + enter) == 0
    assert (home / "configs" / "typed-moe-none.toml").is_file()
    # a suggestion (the first selectable unpinned entry after the bundled pack), pinned under its own name
    assert drive(down * 4 + enter + enter + enter) == 0
    conf = tomllib.loads((home / "configs" / "qwen3-coder-30b-a3b-instruct-none.toml").read_text())
    assert conf["target"]["revision"] == hub.commit_of("Qwen/Qwen3-Coder-30B-A3B-Instruct", "main")
    # no head fits typed-moe yet: the head question offers one from the Hub (a head that fits, then "add it?")
    hub.publish("t/wiz-head", models["head"])
    assert drive(enter + "t/wiz-head" + enter + enter + enter, target="typed-moe", drafter="dflash2",
                 dflash2_quant="bf16") == 0
    conf = tomllib.loads((home / "configs" / "typed-moe-dflash2-bf16.toml").read_text())
    assert conf["drafter"]["head"] == "wiz-head"
