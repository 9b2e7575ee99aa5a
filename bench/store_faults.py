"""Fault campaign on the store (docs/store.md): what a user and an attacker would do to `strata-setup`, run as real
processes against the loopback Hub (tests/setup_wizard/hub_server.py) serving the bundled strata-nano pack as pinned
`hf` entries. Four figures:

  kills      setup killed (SIGKILL) at a random moment, then rerun: reruns that end clean (exit 0, the config's
             artifacts check out, `models verify` passes) out of N, and temporary files left in the store after them
  concurrent n setups at once on one store, a gc loop beside them: setups that succeed out of n
  symlinks   links planted at every scratch and final name of the store pointing at files outside it, and a linked
             store folder: bytes changed outside the store
  gc         setups with configs written outside STRATA_HOME, then `models gc --yes`: items a live config uses that
             gc removed

    python bench/store_faults.py [--kills 20] [--concurrent 4] [--seed 0] [--device cpu]

Prints a table and writes bench/results/store_faults.json ($OUT on the device machine). CPU only: `--device` is
accepted for the bench convention and ignored (the store does no device work).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tomli_w  # noqa: E402

from tests.setup_wizard.hub_server import FakeHub  # noqa: E402

BUNDLED = ROOT / "setup_wizard" / "bundled"
REV_T, REV_H = "1" * 40, "2" * 40
SETUP = [sys.executable, "-c", "from setup_wizard.cli import main; main()"]
TIMEOUT = 300


def _pins(folder: Path) -> list[dict[str, Any]]:
    return [{"path": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file()]


class World:
    """A loopback Hub with `nano` and `nano-head` (the bundled pack) and a catalog pinning them."""

    def __init__(self, work: Path, delay: float) -> None:
        self.work = work
        self.hub = FakeHub().start()
        self.hub.delay = delay
        for repo, rev, folder in (("s/nano", REV_T, BUNDLED / "strata-nano"),
                                  ("s/nano-head", REV_H, BUNDLED / "strata-nano-dflash2")):
            self.hub.add(repo, rev, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
        self.catalog = work / "catalog.toml"
        self.catalog.write_text(tomli_w.dumps({"entry": [
            {"name": "nano", "kind": "target", "source": "hf", "repo": "s/nano", "revision": REV_T, "mtp": True,
             "file": _pins(BUNDLED / "strata-nano")},
            {"name": "nano-head", "kind": "dflash2", "source": "hf", "repo": "s/nano-head", "revision": REV_H,
             "fits": ["nano"], "default": True, "file": _pins(BUNDLED / "strata-nano-dflash2")}]}))

    def env(self, home: Path) -> dict[str, str]:
        e = dict(os.environ)
        e.update(STRATA_HOME=str(home), HF_ENDPOINT=self.hub.url, STRATA_CATALOG=str(self.catalog),
                 HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        e.pop("HF_HUB_OFFLINE", None)
        return e

    def setup(self, home: Path, config: Path, *extra: str) -> subprocess.Popen:
        args = [*SETUP, "--yes", "--no-calibrate", "--target", "nano", "--context", "256",
                "--config-out", str(config), *extra]
        return subprocess.Popen(args, env=self.env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def cmd(self, home: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*SETUP, *args], env=self.env(home), capture_output=True, text=True, timeout=TIMEOUT)

    def stop(self) -> None:
        self.hub.stop()


DFLASH2 = ("--drafter", "dflash2", "--dflash2-quant", "q8_0")


def _config_ok(config: Path) -> bool:
    from runtime.artifact_check import check_config_artifacts
    from runtime.config import load

    try:
        check_config_artifacts(load(config))
        return True
    except Exception:  # noqa: BLE001  (any failure is a finding)
        return False


def _temp_files(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.name.endswith((".tmp", ".part")))


def _state(home: Path, cfg: Path) -> str:
    """Where the killed run had got to: verified items in the store, partial files, the config."""
    from setup_wizard.store import MANIFEST

    if not home.exists():
        return "nothing written"
    verified = len(list(home.rglob(MANIFEST)))
    parts = len([p for p in home.rglob("*.part")])
    return f"{verified} verified items, {parts} .part files, config {'written' if cfg.exists() else 'absent'}"


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    out, _ = p.communicate(timeout=TIMEOUT)
    return p.returncode, out


# ----------------------------------------------------------------------------------------------------- campaigns

class _Watch:
    """Drains a setup's output in a thread and notes when its steps start (the first step line)."""

    MARK = "download nano"

    def __init__(self, p: subprocess.Popen) -> None:
        self.p, self.lines = p, []
        self.started = threading.Event()
        self.t0 = 0.0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            if self.MARK in line and not self.started.is_set():
                self.t0 = time.monotonic()
                self.started.set()
        self.started.set()


def kills(world: World, n: int, rng: random.Random) -> dict[str, Any]:
    """Kill a setup (SIGKILL) at a random moment of its steps, then rerun it: count clean reruns and temp files
    left. The moment is drawn over the steps' duration measured on a first run, from the first step line on; runs
    that finish before their moment are drawn again, so `n` runs are really killed."""
    probe = world.setup(world.work / "kills-probe", world.work / "probe.toml", *DFLASH2)
    w = _Watch(probe)
    probe.wait(timeout=TIMEOUT)
    w.thread.join()
    work = time.monotonic() - w.t0
    rows, clean, left, attempts = [], 0, 0, 0
    while len(rows) < n and attempts < 3 * n:
        attempts += 1
        i = attempts
        home = world.work / f"kills-{i}"
        cfg = world.work / f"kills-{i}.toml"
        at = rng.uniform(0, work)
        p = world.setup(home, cfg, *DFLASH2)
        w = _Watch(p)
        w.started.wait(TIMEOUT)
        try:
            p.wait(timeout=max(at - (time.monotonic() - w.t0), 0))
            continue                          # finished before its moment: not a kill, draw again
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        w.thread.join()
        before = _temp_files(home) if home.exists() else []
        state = _state(home, cfg)
        rc, out = _finish(world.setup(home, cfg, *DFLASH2))
        verify = world.cmd(home, "models", "verify", "--json")
        temps = _temp_files(home)
        ok = rc == 0 and _config_ok(cfg) and verify.returncode == 0
        clean += ok
        left += len(temps)
        rows.append({"kill_at_s": round(at, 2), "after_kill": state, "temps_after_kill": len(before),
                     "rerun_rc": rc, "clean": ok, "temps_left": temps, "tail": "" if ok else out[-300:]})
    return {"runs": len(rows), "clean_reruns": clean, "temp_files_left": left, "steps_s": round(work, 1),
            "attempts": attempts, "rows": rows}


def concurrent(world: World, n: int) -> dict[str, Any]:
    """n setups at once on one store (half DFlash2, half MTP), with `models gc --yes` looping beside them."""
    home = world.work / "concurrent"
    cfgs = [world.work / "concurrent-configs" / f"c{i}.toml" for i in range(n)]
    procs = [world.setup(home, c, *(DFLASH2 if i % 2 == 0 else ())) for i, c in enumerate(cfgs)]
    gcs = 0
    gc_removed_used: list[str] = []
    while any(p.poll() is None for p in procs):
        r = world.cmd(home, "models", "gc", "--yes", "--json")
        gcs += 1
        if r.returncode == 0:
            live = {str(c) for c in cfgs if c.exists()}
            gc_removed_used += [x["name"] for x in json.loads(r.stdout)["removed"] if set(x["used_by"]) & live]
    results = [_finish(p) for p in procs]
    ok = sum(rc == 0 and _config_ok(c) for (rc, _), c in zip(results, cfgs, strict=True))
    verify = world.cmd(home, "models", "verify", "--json")
    return {"setups": n, "succeeded": ok, "gc_runs_beside": gcs, "verify_ok": verify.returncode == 0,
            "used_items_removed_by_gc": gc_removed_used,
            "failures": [out[-300:] for rc, out in results if rc != 0]}


def symlinks(world: World) -> dict[str, Any]:
    """Links at every name the store writes, pointing at files outside it; a linked store folder."""
    home = world.work / "symlinks"
    outside = world.work / "outside"
    outside.mkdir()
    victims: dict[Path, bytes] = {}

    def victim(name: str) -> Path:
        v = outside / name
        v.write_bytes(f"precious {name}\n".encode() * 64)
        victims[v] = v.read_bytes()
        return v

    from setup_wizard.store import MANIFEST

    t = home / "downloads" / "s--nano" / REV_T
    h = home / "downloads" / "s--nano-head" / REV_H
    for folder, files in ((t, _pins(BUNDLED / "strata-nano")), (h, _pins(BUNDLED / "strata-nano-dflash2"))):
        folder.mkdir(parents=True)
        for f in files:
            (folder / (f["path"] + ".part")).symlink_to(victim(f"{folder.parent.name}-{f['path']}.part"))
        (folder / files[0]["path"]).symlink_to(victim(f"{folder.parent.name}-{files[0]['path']}"))
        (folder / MANIFEST).symlink_to(victim(f"{folder.parent.name}-manifest"))
    from setup_wizard.store_locks import item_key

    (home / "locks").mkdir()
    for key in (item_key(home, t), item_key(home, h), "registry", "store"):
        (home / "locks" / f"{key}.lock").symlink_to(victim(f"lock-{key}"))
    (home / "config-registry.json").symlink_to(victim("registry"))
    rc1, out1 = _finish(world.setup(home, world.work / "symlinks.toml", *DFLASH2))
    # a store folder that is itself a link to a folder outside: refused, nothing written there
    home2 = world.work / "symlinks2"
    (home2 / "downloads").mkdir(parents=True)
    elsewhere = outside / "elsewhere"
    elsewhere.mkdir()
    (home2 / "downloads" / "s--nano").symlink_to(elsewhere)
    rc2, out2 = _finish(world.setup(home2, world.work / "symlinks2.toml"))
    changed = sum(len(b) for v, b in victims.items() if not v.exists() or v.read_bytes() != b)
    changed += sum(p.stat().st_size for p in elsewhere.rglob("*") if p.is_file())
    return {"links_planted": len(victims) + 1, "outside_bytes_changed": changed,
            "setup_with_links_rc": rc1, "linked_folder_rc": rc2, "linked_folder_message": out2.strip()[-300:],
            "config_ok": _config_ok(world.work / "symlinks.toml")}


def gc_outside(world: World) -> dict[str, Any]:
    """Configs written outside STRATA_HOME (like the README's ./strata-nano.toml), then `models gc --yes`."""
    home = world.work / "gc"
    cfgs = [world.work / "gc-a" / "nano.toml", world.work / "gc-b" / "nano-dflash2.toml"]
    rcs = [_finish(world.setup(home, cfgs[0]))[0], _finish(world.setup(home, cfgs[1], *DFLASH2))[0]]
    world.cmd(home, "models", "pull", "nano-head")           # used only through the converted drafter's source
    r = world.cmd(home, "models", "gc", "--yes", "--json")
    res = json.loads(r.stdout) if r.returncode == 0 else {"removed": [], "error": r.stdout + r.stderr}
    used = [x for x in res["removed"] if x.get("used_by")]
    broken = [str(c) for c in cfgs if not _config_ok(c)]
    return {"setups_rc": rcs, "gc_rc": r.returncode, "removed": [x["name"] for x in res["removed"]],
            "used_items_removed": len(used) + len(broken), "configs_broken_after_gc": broken}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.01, help="Hub seconds per 64 KiB (a slow link)")
    ap.add_argument("--device", default="cpu", help="accepted and ignored (the store does no device work)")
    ap.add_argument("--only", choices=("kills", "concurrent", "symlinks", "gc"), action="append")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    only = set(args.only or ("kills", "concurrent", "symlinks", "gc"))
    res: dict[str, Any] = {"seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="store-faults-") as tmp:
        world = World(Path(tmp), args.delay)
        try:
            if "symlinks" in only:
                res["symlinks"] = symlinks(world)
            if "gc" in only:
                res["gc"] = gc_outside(world)
            if "concurrent" in only:
                res["concurrent"] = concurrent(world, args.concurrent)
            if "kills" in only:
                res["kills"] = kills(world, args.kills, rng)
        finally:
            world.stop()
    from bench.common import out_dir, print_table, write_json

    if args.only and (out_dir() / "store_faults.json").is_file():   # a partial run updates the earlier figures
        res = {**json.loads((out_dir() / "store_faults.json").read_text()), **res}
        only = {k for k in ("kills", "concurrent", "symlinks", "gc") if k in res}
    rows = []
    if "kills" in res:
        k = res["kills"]
        rows.append(["kills at random points", f"{k['clean_reruns']} of {k['runs']} reruns clean",
                     f"{k['temp_files_left']} temp files left", f"{k['runs']} of {k['runs']}, 0 left"])
    if "concurrent" in res:
        c = res["concurrent"]
        rows.append(["concurrent setups + gc loop", f"{c['succeeded']} of {c['setups']} succeed",
                     f"{c['gc_runs_beside']} gc runs, {len(c['used_items_removed_by_gc'])} used removed",
                     f"{c['setups']} of {c['setups']}"])
    if "symlinks" in res:
        s = res["symlinks"]
        rows.append(["symlink writes", f"{s['outside_bytes_changed']} outside bytes changed",
                     f"{s['links_planted']} links; setup rc {s['setup_with_links_rc']}, linked folder rc "
                     f"{s['linked_folder_rc']}", "0"])
    if "gc" in res:
        g = res["gc"]
        rows.append(["gc with outside configs", f"{g['used_items_removed']} used items removed",
                     f"removed: {', '.join(g['removed']) or 'nothing'}", "0"])
    print_table("Store fault campaign", ["fault", "result", "detail", "bound"], rows)
    print(f"wrote {write_json('store_faults.json', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
