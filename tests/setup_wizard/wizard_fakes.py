"""Fakes for the wizard tests: a machine, and the other areas' services over tiny real folders.

The fake catalog has a bundled target `nano` (tiny Qwen3-MoE with an MTP head), a `big` hf target that is not
downloaded, an unpinned target, and two DFlash2 heads for `nano` (`official` default, `turbo`). Conversion uses the
test-side GGUF writer of tests/runtime/drafters/dflash2 (a real GGUF the runtime can read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calibrate.results import CalibrationResult
from setup_wizard.config import manifest_sha256, sha256_file
from setup_wizard.hardware import GPU, Hardware
from setup_wizard.inspection import hash_folder
from setup_wizard.services import Artifact, HeadOption, TargetOption

GIB = 1 << 30


def fake_gpu(total_gib: float = 16, free_gib: float = 15) -> Hardware:
    return Hardware(gpus=(GPU(0, "Fake GPU 16G", int(total_gib * GIB), int(free_gib * GIB), (8, 9)),),
                    ram_total_bytes=64 * GIB, ram_available_bytes=60 * GIB, disk_free_bytes=500 * GIB, cpu_count=8,
                    cpu_name="cpu: fake")


def fake_cpu(ram_gib: float = 8) -> Hardware:
    return Hardware(ram_total_bytes=int(ram_gib * GIB), ram_available_bytes=int(ram_gib * GIB * 0.9),
                    disk_free_bytes=100 * GIB, cpu_count=2, cpu_name="cpu: fake")


def make_pack(root: Path) -> dict[str, Path]:
    """A tiny target with MTP (hidden 64 so DFlash2 rows quantize) and two DFlash2 heads that fit it."""
    from tests.runtime.drafters.dflash2.helpers import drafter_config, write_hf_drafter
    from tests.runtime.tiny import make_tiny_target

    target = make_tiny_target(root, "nano", hidden=64, vocab=80, layers=3, mtp=True)
    cfg = drafter_config(hidden=64, vocab=80, taps=(0, 2), block_size=4)
    official = write_hf_drafter(root / "heads" / "official", cfg, seed=1)
    turbo = write_hf_drafter(root / "heads" / "turbo", cfg, seed=2)
    return {"nano": target, "official": official, "turbo": turbo}


@dataclass
class FakeServices:
    pack: dict[str, Path]
    store: Path
    calls: list[tuple[str, Any]] = field(default_factory=list)
    interrupt_on: str | None = None  # raise KeyboardInterrupt when this call happens
    calibration: dict[str, Any] = field(default_factory=lambda: {
        "block": 3, "spec_min_p": 0.3, "source": "calibrated", "decision": "winner", "seconds": 1.5})

    def targets(self) -> list[TargetOption]:
        return [
            TargetOption("nano", "bundled", local_path=self.pack["nano"], size_bytes=300_000, has_mtp=True),
            TargetOption("big", "hf", size_bytes=40 * GIB, has_mtp=True, description="not downloaded"),
            TargetOption("unpinned", "hf", pinned=False),
        ]

    def heads(self, target: str) -> list[HeadOption]:
        if target != "nano":
            return []
        return [HeadOption("official", default=True, size_bytes=1_000_000),
                HeadOption("turbo", size_bytes=1_000_000, description="fine-tune")]

    def _check(self, what: str) -> None:
        if self.interrupt_on == what:
            raise KeyboardInterrupt

    def remote_geometry(self, name: str) -> Any | None:
        return None

    def fetch(self, name: str, *, offline: bool) -> Artifact:
        self.calls.append(("fetch", name))
        self._check("fetch")
        folder = self.pack[name]
        art = hash_folder(folder)
        if name != "nano":
            st = folder / "model.safetensors"
            return Artifact(path=folder, sha256=sha256_file(st), size=st.stat().st_size, reused=True)
        return Artifact(path=art.path, sha256=manifest_sha256(art.files), files=art.files, size=art.size,
                        reused=True)

    def convert(self, head_dir: Path, quant: str, *, source: Artifact) -> Artifact:
        from tests.runtime.drafters.dflash2.helpers import write_gguf_drafter

        self.calls.append(("convert", (Path(head_dir).name, quant)))
        self._check("convert")
        out = self.store / "converted" / f"{source.sha256[:16]}-{quant}.gguf"
        reused = out.is_file()
        if not reused:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".part")
            write_gguf_drafter(tmp, head_dir, quant=quant)
            tmp.rename(out)
        return Artifact(path=out, sha256=sha256_file(out), size=out.stat().st_size, reused=reused)

    def convert_target(self, folder: Path, quant: str, *, source: Artifact) -> Artifact:
        """The real target converter into the fake store (the folder needs a byte-level BPE tokenizer)."""
        from setup_wizard.convert_target import convert_target_to_store
        from setup_wizard.store import Store

        self.calls.append(("convert_target", (Path(folder).name, quant)))
        self._check("convert_target")
        res = convert_target_to_store(folder, quant, Store(self.store), source_sha=source.sha256)
        files = {res.path.name: {"sha256": res.sha256, "size": res.size}}
        if res.mtp_path is not None:
            files[res.mtp_path.name] = {"sha256": res.mtp_sha256, "size": res.mtp_size}
        return Artifact(path=res.path, sha256=res.sha256, size=res.total_size, files=files, reused=res.reused,
                        source_sha256=res.source_sha256)

    def compile_steps(self, doc: dict[str, Any]) -> str:
        self.calls.append(("compile_steps", doc["target"]["path"]))
        self._check("compile_steps")
        return ""

    def calibrate(self, doc: dict[str, Any], *, force: bool, max_seconds: float | None) -> CalibrationResult:
        self.calls.append(("calibrate", doc["target"]["path"]))
        self._check("calibrate")
        from calibrate.key import key_for_config

        key = key_for_config(doc, device=(doc["device"]["name"], doc["device"]["total_mib"]))
        c = self.calibration
        return CalibrationResult(block=c["block"], spec_min_p=c["spec_min_p"], source=c["source"],
                                 decision=c["decision"], reason="", key=key, record={"seconds": c["seconds"]})
