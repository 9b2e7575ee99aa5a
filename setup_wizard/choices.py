"""What the user (or a script) answered: flags, an answers file, the wizard's questions; checked before anything
is downloaded or written (one sentence each, exit code 2)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from runtime.drafters.registry import KINDS
from runtime.errors import UsageError, one_of
from runtime.formats.registry import QTYPES
from runtime.formats.target_gguf import TARGET_QUANTS

QUANTS = QTYPES


DRAFTERS = tuple(KINDS)
# what --kv-dtype takes: the CPU's compute dtype, bf16 (a GPU's compute dtype; beside fp32 weights on a CPU), q8_0
KV_CACHES = ("fp32", "bf16", "q8_0")


@dataclass
class Choices:
    """What the user (or a script) said. None = take the recommendation."""

    target: str | None = None
    drafter: str | None = None
    dflash2_head: str | None = None
    dflash2_quant: str | None = None
    target_quant: str | None = None   # bf16 | q8_0 | q4_0: how the target is stored (a local .gguf says itself)
    context: int | None = None
    kv_dtype: str | None = None       # the target's KV cache: the compute dtype (None), bf16 on a CPU, or q8_0
    vram_reserve_mib: int | None = None
    vram_limit_mib: int | None = None
    calibrate: bool | None = None
    offline: bool = False
    config_out: Path | None = None
    # why an answer was given, when the wizard's user took its recommendation (shown in the summary)
    notes: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """The checks that need no machine or catalog (one sentence each)."""
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise UsageError(f"Unknown drafter '{self.drafter}'; use --drafter {one_of(DRAFTERS)}.")
        if self.dflash2_quant is not None and self.dflash2_quant not in QUANTS:
            raise UsageError(f"Unknown DFlash2 quantization '{self.dflash2_quant}'; use --dflash2-quant "
                             f"{one_of(QUANTS)}.")
        if self.target_quant is not None and self.target_quant not in TARGET_QUANTS:
            raise UsageError(f"Unknown target quantization '{self.target_quant}'; use --target-quant "
                             f"{one_of(TARGET_QUANTS)}.")
        if self.drafter is not None and not KINDS[self.drafter].needs_file and (self.dflash2_head or self.dflash2_quant):
            raise UsageError(f"--drafter {self.drafter} cannot be combined with --dflash2-head/--dflash2-quant; "
                             "pass --drafter dflash2 or drop the DFlash2 flags.")
        if self.kv_dtype is not None and self.kv_dtype not in KV_CACHES:
            raise UsageError(f"Unknown KV cache format '{self.kv_dtype}'; use --kv-dtype {one_of(KV_CACHES)}.")
        if self.context is not None and self.context <= 0:
            raise UsageError(f"--context must be a positive number of tokens, not {self.context}.")
        if self.vram_reserve_mib is not None and self.vram_reserve_mib < 0:
            raise UsageError(f"--vram-reserve-mib cannot be negative ({self.vram_reserve_mib}).")
        if self.vram_limit_mib is not None and self.vram_limit_mib <= 0:
            raise UsageError(f"--vram-limit-mib must be a positive number of MiB, got {self.vram_limit_mib}.")
        if self.config_out is not None:
            check_config_out(Path(self.config_out).expanduser())


def check_config_out(path: Path) -> None:
    """Refuse a --config-out that can never be written, before anything is downloaded or converted."""
    if path.is_dir():
        raise UsageError(f"--config-out {path} is a folder; pass a file path such as {path / 'strata.toml'}.")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--config-out {path} is not in a writable folder ({parent} is not one); "
                         f"pass a path you can write to.")


ANSWER_KEYS = {f: f for f in ("target", "drafter", "dflash2_head", "dflash2_quant", "target_quant", "context",
                              "kv_dtype", "vram_reserve_mib", "vram_limit_mib", "calibrate", "offline", "config_out")}


def load_answers(path: Path) -> Choices:
    """An answers file: TOML with the flag names as keys (`dflash2-quant` or `dflash2_quant`)."""
    import tomllib

    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"The answers file {path} does not exist; pass the path of a TOML answers file.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"The answers file {path} is not valid TOML ({exc}).") from None
    except OSError as exc:
        raise UsageError(f"The answers file {path} cannot be read ({exc.strerror or exc}); pass a readable TOML "
                         f"file.") from None
    out = Choices()
    for key, value in raw.items():
        k = key.replace("-", "_")
        if k not in ANSWER_KEYS:
            raise UsageError(f"The answers file has an unknown key '{key}'; allowed: "
                             f"{', '.join(sorted(ANSWER_KEYS))}.")
        want = {"context": int, "vram_reserve_mib": int, "vram_limit_mib": int, "calibrate": bool,
                "offline": bool}.get(k, str)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise UsageError(f"The answers file key '{key}' must be {want.__name__}, not {value!r}.")
        setattr(out, k, Path(value).expanduser() if k == "config_out" else value)
    return out


def merge_choices(base: Choices, override: Choices) -> Choices:
    """Flags win over the answers file."""
    out = replace(base)
    for k in ANSWER_KEYS:
        v = getattr(override, k)
        if v is not None and not (k == "offline" and v is False):
            setattr(out, k, v)
    return out
