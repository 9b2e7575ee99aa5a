"""The calibration key (docs/calibration.md): a stored result is reused only when every field matches.

`(device name and memory, target sha256, drafter kind, drafter artifact sha256, quantization, context, runtime
version, target quantization, drafter step)`. The device is the live machine (not what an old config says), so a config copied to another machine
is recalibrated there.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from runtime import aoti
from runtime.drafters.registry import KINDS
from runtime.errors import UsageError
from runtime.hostinfo import cpu_name, ram_bytes
from runtime.version import __version__ as RUNTIME_VERSION


class CalibrationConfigError(UsageError):
    """The config lacks something the calibration key needs (one sentence; exit code 2)."""


@dataclass(frozen=True)
class CalibrationKey:
    device_name: str
    device_total_mib: int
    target_sha256: str
    drafter_kind: str
    drafter_sha256: str
    quantization: str
    context: int
    runtime_version: str
    target_quantization: str = "bf16"     # how the target is stored (a quantized target drafts and verifies differently)
    # which CPU steps run compiled: "compiled" (the MTP chain, runtime/drafters/mtp_compiled.py), "target" (the
    # target's step, runtime/target_compiled.py), "target+compiled" (both): cheaper steps calibrate to other settings
    drafter_step: str = ""
    # the target's KV cache when it is not in the compute dtype ("bf16" beside fp32 weights on a CPU, "q8_0"): it
    # changes what a step reads at long contexts, so what pays; "" the compute dtype's cache
    kv_cache: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationKey:
        try:
            return cls(device_name=str(d["device_name"]), device_total_mib=int(d["device_total_mib"]),
                       target_sha256=str(d["target_sha256"]), drafter_kind=str(d["drafter_kind"]),
                       drafter_sha256=str(d["drafter_sha256"]), quantization=str(d["quantization"]),
                       context=int(d["context"]), runtime_version=str(d["runtime_version"]),
                       target_quantization=str(d.get("target_quantization", "bf16")),
                       drafter_step=str(d.get("drafter_step", "")), kv_cache=str(d.get("kv_cache", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationConfigError(f"a calibration key is incomplete or malformed ({e}).") from None

    @property
    def digest(self) -> str:
        """A stable file name for the key: sha256 of its canonical JSON (the stored record repeats the key)."""
        d = self.to_dict()
        for field in ("drafter_step", "kv_cache"):    # empty: keys stored before the field existed name this file
            if not d[field]:
                del d[field]
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def current_device(device_type: str | None = None) -> tuple[str, int]:
    """(name, total MiB) of the device calibration runs on: the CUDA device, or this CPU and its RAM."""
    import torch

    t = (device_type or "auto").lower()
    if not _on_cpu(device_type):      # the same numbers setup_wizard.hardware reports (mem_get_info total)
        index = int(t.split(":")[1]) if t.startswith("cuda:") and t.split(":")[1].isdigit() else 0
        props = torch.cuda.get_device_properties(index)
        try:
            total = int(torch.cuda.mem_get_info(index)[1])
        except RuntimeError:
            total = int(props.total_memory)
        return str(props.name), total // 2**20
    return cpu_name(), ram_bytes()[0] // 2**20


def _table(config: dict[str, Any], name: str) -> dict[str, Any]:
    t = config.get(name) or {}
    if not isinstance(t, dict):
        raise CalibrationConfigError(f"the config's [{name}] is not a table; re-run strata-setup to rewrite it.")
    return t


def drafter_kind(config: dict[str, Any]) -> str:
    """The config's drafter kind: "mtp", "dflash2" or "none"."""
    kind = str(_table(config, "drafter").get("kind", "none") or "none").lower()
    if kind not in KINDS:
        raise CalibrationConfigError(f"the config's drafter kind '{kind}' is not one of {', '.join(KINDS)}.")
    return kind


def key_for_config(config: dict[str, Any], *, device: tuple[str, int] | None = None) -> CalibrationKey:
    """The calibration key of a strata-setup config on this machine (`device` overrides the probe, for tests)."""
    target = _table(config, "target")
    drafter = _table(config, "drafter")
    memory = _table(config, "memory")
    kind = drafter_kind(config)
    tsha = str(target.get("sha256") or "")
    if not tsha:
        raise CalibrationConfigError("the config has no [target] sha256; re-run strata-setup to record it.")
    dsha = str(drafter.get("sha256") or "")
    quant = str(drafter.get("quantization") or "")
    if kind == "mtp":          # the MTP head lives inside the target checkpoint and is stored as the target is
        dsha = dsha or tsha
        quant = quant or "native"
    elif KINDS[kind].needs_file and not dsha:
        raise CalibrationConfigError("the config has no [drafter] sha256 for the DFlash2 artifact; "
                                     "re-run strata-setup to record it.")
    elif KINDS[kind].needs_file and not quant:
        raise CalibrationConfigError("the config has no [drafter] quantization for the DFlash2 artifact; "
                                     "re-run strata-setup to record it.")
    try:
        context = int(memory.get("context"))
    except (TypeError, ValueError):
        raise CalibrationConfigError("the config has no valid [memory] context; re-run strata-setup.") from None
    dev_type = str(_table(config, "device").get("type") or "") or None
    if device is None:
        device = current_device(dev_type)
    # on a CPU with float weights the target's step runs compiled too (runtime/target_compiled.py)
    float_target = str(target.get("quantization") or "bf16") in ("bf16", "f16", "f32")
    parts = ([("target+" if float_target else "") + "compiled"] if kind == "mtp" else
             ["target"] if float_target and kind != "none" else [])
    step = parts[0] if parts and _on_cpu(dev_type) and aoti.wanted() else ""
    return CalibrationKey(device_name=device[0], device_total_mib=int(device[1]), target_sha256=tsha,
                          drafter_kind=kind, drafter_sha256=dsha if kind != "none" else "",
                          quantization=quant if kind != "none" else "", context=context,
                          runtime_version=RUNTIME_VERSION,
                          target_quantization=str(target.get("quantization") or "bf16"), drafter_step=step,
                          kv_cache=kv_cache_of(memory, _on_cpu(dev_type)))


# the dtype names a config may give (runtime/config.py DTYPES), by the format they mean
_CANONICAL = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
              "float16": "fp16"}


def kv_cache_of(memory: dict[str, Any], cpu: bool) -> str:
    """The key's `kv_cache`: "" where the cache is in the compute dtype ([memory] dtype, else fp32 on a CPU and bf16
    on a GPU), else the cache's format."""
    kv = str(memory.get("kv_dtype") or "")
    if not kv:
        return ""
    compute = _CANONICAL.get(str(memory.get("dtype") or ""), "fp32" if cpu else "bf16")
    kv = _CANONICAL.get(kv, kv)
    return "" if kv == compute else kv


def _on_cpu(device_type: str | None) -> bool:
    """Whether the engine runs on the CPU for this device setting (runtime.engine: None/"auto" = CUDA when
    present, "cuda:N")."""
    import torch

    t = (device_type or "auto").lower()
    return not ((t in ("auto", "gpu") or t.split(":")[0] == "cuda") and torch.cuda.is_available())
