"""The compiled CPU target step's attention op (`strata::window_attention`, runtime/csrc/window_attention.cpp): each
window row's scores, softmax and value sum in C++, with a fixed per-row order of operations (docs/models.md,
"Compiled CPU steps", "The attention op").

Why: in the wide step (a verify window) the attention written as torch ops took three quarters of the step at 3k
tokens of context, mostly in the 128-position chunk products that kept a row's sum order fixed, and a small BLAS
product's fixed costs; the op keeps the order fixed by construction and reads each key and value row once. It is built with this machine's C++ compiler (the one AOTInductor
uses for the packages) into the store's compiled/ directory next to the packages that call it, and loaded into
the process, checked, before any of them: a package built with the op calls it through the dispatcher. Where it
cannot be built or fails its check, the packages keep the torch-op attention (`registered()` is part of their key).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "window_attention.cpp"
FORMAT = 1
# -ffp-contract=off: the source's products and sums stay separate roundings in every loop (a row's arithmetic must
# not depend on which loop ran it); -march=native: the library is keyed by this CPU's model and flags
FLAGS = ("-O3", "-march=native", "-std=c++20", "-ffp-contract=off", "-fPIC", "-shared", "-w")

_state: dict = {"path": None, "failed": ""}


def compiler() -> str | None:
    """The C++ compiler: $CXX, else the first of c++, g++, clang++ on the PATH."""
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env)
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout.splitlines() or [""])[0]


def library_path(root: Path, cxx: str) -> Path:
    """Where the op's library for this machine, source, torch and compiler lives under `root`."""
    from runtime import aoti

    desc = {"source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(), "cxx": _compiler_id(cxx), "flags": FLAGS}
    return root / f"attention-op-{aoti.key('cpu-attention', desc, FORMAT)}.so"


def registered() -> bool:
    """Whether this process has the op loaded and checked (the compiled target step then calls it)."""
    return _state["path"] is not None


def ensure(root: Path, build: bool) -> str:
    """Load the op from the store under `root` (built there first when missing or damaged and `build`): "" once it
    is registered in this process and its library is under `root`, else why not."""
    if _state["failed"]:
        return _state["failed"]
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler (c++, g++ or clang++) on the PATH"
    try:
        path = library_path(root, cxx)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the C++ compiler did not answer ({type(exc).__name__})"
    if registered():
        if build and _damaged(path):             # this store gets the library the process loaded elsewhere
            src = Path(_state["path"])
            _place(src.read_bytes(), path)
        return ""
    why = _damaged(path)
    if why and not build:
        return why
    if why:
        try:
            _build(cxx, path)
        except Exception as exc:
            _state["failed"] = f"building the attention op failed ({type(exc).__name__}: {str(exc).strip()[:300]})"
            return _state["failed"]
        return ""
    try:
        _load(path)
    except Exception as exc:                     # not the op this source makes: the torch-op attention
        _state["failed"] = f"the attention op {path.name} would not load ({str(exc).strip()[:200]})"
        return _state["failed"]
    return ""


def _digest_path(path: Path) -> Path:
    return path.with_suffix(".sha256")


def _damaged(path: Path) -> str:
    """Why the library at `path` must not be loaded ("" when it may): missing, or not the bytes recorded when it
    was built (a damaged shared library can crash the process that loads it, so it is hashed first)."""
    dg = _digest_path(path)
    if not path.is_file() or not dg.is_file():
        return "not built for this machine yet (strata-setup builds it)"
    if hashlib.sha256(path.read_bytes()).hexdigest() != dg.read_text().strip():
        return f"the attention op {path.name} is damaged (its sha256 is not the one recorded when it was built)"
    return ""


def _place(data: bytes, path: Path) -> None:
    """Write the library and its digest under temporary names, then rename them: the digest first, so a library
    under its name always has the digest it was written with."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    tmp, tdg = path.with_name(f".{path.name}.{pid}.tmp"), path.with_name(f".{path.stem}.{pid}.tmp.sha256")
    try:
        tmp.write_bytes(data)
        tdg.write_text(hashlib.sha256(data).hexdigest() + "\n")
        os.replace(tdg, _digest_path(path))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        tdg.unlink(missing_ok=True)


def _build(cxx: str, path: Path) -> None:
    """Compile under a temporary name, load and check it from there, then put it and its digest into place."""
    base = Path(torch.__file__).parent
    inc = [f"-I{base / 'include'}", f"-I{base / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    lib = base / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.build.so")
    cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *inc, str(SOURCE), "-o", str(tmp), f"-L{lib}",
           f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            said = (out.stderr or out.stdout).strip().splitlines()
            raise RuntimeError(said[-1] if said else f"exit status {out.returncode}")
        _load(tmp)
        _place(tmp.read_bytes(), path)
        _state["path"] = str(path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> None:
    torch.ops.load_library(str(path))

    @torch.library.register_fake("strata::window_attention")
    def _(q, kc, vc, seen, grp):
        return torch.empty_like(q)

    why = check()
    if why:
        raise RuntimeError(why)
    _state["path"] = str(path)


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seen: torch.Tensor, grp: int) -> torch.Tensor:
    """What the op computes, in float64 torch: each line's softmax over keys 0..its row's position of its scores
    against the cache, times the values."""
    N = int(seen.max()) + 1
    pos = seen.repeat_interleave(grp)                                    # [lines]
    s = q.double() @ kc[:, :N].double().transpose(1, 2)
    s = s.masked_fill(torch.arange(N)[None, None, :] > pos[None, :, None], float("-inf"))
    return (torch.softmax(s, -1) @ vc[:, :N].double()).float()


def check() -> str:
    """Why the loaded op does not compute its attention ("" when it does): against `reference` on random inputs
    (the cache's last slot included), and one row's bits alone and inside a window of other rows."""
    gen = torch.Generator().manual_seed(0)
    nkv, grp, hd, slots = 2, 2, 64, 170
    kc, vc = torch.randn(nkv, slots, hd, generator=gen), torch.randn(nkv, slots, hd, generator=gen)
    seen = torch.tensor([37, 150, 169, 0])
    q = torch.randn(nkv, 4 * grp, hd, generator=gen)
    got = torch.ops.strata.window_attention(q, kc, vc, seen, grp)
    want = reference(q, kc, vc, seen, grp)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        return f"the attention op is off by {float((got - want).abs().max()):.1e} from float64"
    alone = torch.ops.strata.window_attention(q[:, 2:4].contiguous(), kc, vc, seen[1:2], grp)
    if not torch.equal(alone, got[:, 2:4]):
        return "the attention op gives a row other bits inside a window than alone"
    return ""
