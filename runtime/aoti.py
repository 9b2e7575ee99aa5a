"""What the CPU steps compiled ahead of time by AOTInductor share: the switch, the package's machine key, writing a
package safely and loading one without inductor (docs/models.md, "Compiled CPU steps").

Why a package and not torch.compile: a package is built once per machine (strata-setup does it) and loads in
milliseconds; torch.compile's guards and wrappers cost a fifth of a small step again, at every call, and its compile
runs at every start. Users: runtime/drafters/mtp_compiled.py (the MTP head's step) and runtime/target_compiled.py
(the target's fixed-width step).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# the compiled CPU steps (False, or STRATA_COMPILE=0 in the environment: the eager steps everywhere)
ENABLED = True


def wanted() -> bool:
    """Whether CPU engines use (and setup builds) compiled steps: the switch and the environment's say."""
    return ENABLED and os.environ.get("STRATA_COMPILE", "1") != "0"


def key(kind: str, shape: dict[str, Any], fmt: int) -> str:
    """A package's name: a hash of its kind, torch's version, the CPU (its model and feature flags: a package built
    for one vector ISA may crash on another), the code's format and `shape` (every size and constant the compiled
    code holds). Made without importing inductor (a second at start-up)."""
    from runtime.hostinfo import cpu_flags, cpu_name

    desc = {"kind": kind, "torch": torch.__version__, "cpu": cpu_name(),
            "flags": hashlib.sha256(cpu_flags().encode()).hexdigest(), "format": fmt, **shape}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]


def loader(path: str | Path):
    """The package's loader (`boxed_run(list of tensors)` -> list), straight from torch's C++ API: importing inductor
    for its Python wrapper would cost a second at every start, and the wrapper parses the input and output specs
    from JSON on every call (a fifth of a small step's time)."""
    aoti = getattr(torch._C, "_aoti", None)
    if aoti is not None and hasattr(aoti, "AOTIModelPackageLoader"):
        return aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    return torch._inductor.aoti_load_package(str(path)).loader


def export(module: torch.nn.Module, args: tuple, dynamic_shapes: tuple):
    """torch.export of `module` without torch's own deprecation chatter (a setup's output is for the user)."""
    import warnings

    from torch.export import export as _export

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        return _export(module, args, dynamic_shapes=dynamic_shapes)


def write_package(ep, path: Path, check: Callable[[Callable[..., list]], None]) -> None:
    """Compile the exported program `ep` into `path`: under a temporary name first, `check(runner)` run on it
    (raises when it does not compute its step), then renamed, so a half-written or wrong package never sits under
    a name a later run would load."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            out = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
        ld = loader(out)
        check(lambda *a: ld.boxed_run(list(a)))
        os.replace(out, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def open_package(path: Path, check: Callable[[Callable[..., list]], None], what: str) -> tuple[Any, str]:
    """(loader, "") for the package at `path` once `check` passed on it, or (None, why not): missing, damaged,
    foreign or wrong. A file is not trusted for being there: it must compute its step (a few milliseconds)."""
    if not path.is_file():
        return None, "not built for this machine yet (strata-setup builds it)"
    try:
        ld = loader(path)
    except Exception as exc:                  # a damaged or foreign package: eager, and the reason
        return None, f"the package {path.name} would not load ({type(exc).__name__})"
    try:
        check(lambda *a: ld.boxed_run(list(a)))
    except Exception as exc:
        return None, f"the package {path.name} does not compute {what} ({str(exc).strip()[:200]})"
    return ld, ""
