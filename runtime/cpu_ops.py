"""The compiled CPU steps' own ops (runtime/csrc/cpu_ops.cpp; docs/models.md, "Compiled CPU steps", "The attention
op" and "MTP head"):
- `strata::window_attention`: the target step's attention, each window row's scores, softmax and value sum with a
  fixed per-row order of operations. Why: in the wide step (a verify window) the attention written as torch ops
  took three quarters of the step at 3k tokens of context, mostly in the 128-position chunk products that kept a
  row's sum order fixed and in a small BLAS product's fixed costs; the op keeps the order fixed by construction and
  reads each key and value row once.
  The MTP chain's step takes it for its row too (over slots 0..its own, once the step has written its rows).
- `strata::moe_rows`: the target step's routed experts, each row's own k experts in top-k order (no expert
  computed for a row that did not pick it), with a fixed per-row order of operations, over fp32 or bf16 weights.
- `strata::rows16`: the target step's dense products (q/k/v, o_proj, the vocabulary head) from bf16 copies of the
  weights in fp32 arithmetic, a row's sums in a fixed order of its own: half the bytes of the fp32 products where
  the weights are bf16 values (runtime/target_compiled.py `W16`).
- `strata::int8_head`: the MTP chain's vocabulary product from its int8 rows with the input in int16 (integer
  dot products): under half of torch's weight-only int8 kernel's time on the bundled pack's head. The chain's
  fc, q/k/v and o_proj go through it too; `strata::int8_head_top` adds each row's greedy token and probability
  (the draft and the floor's statistic) while the logits are in cache, and `strata::moe_rows8` computes the
  chain's routed experts from int8 rows by the same product.

They are built with this machine's C++ compiler (the one AOTInductor uses for the packages) into the store's
compiled/ directory next to the packages that call them, and loaded into the process, checked, before any of them:
a package built with an op calls it through the dispatcher. Where they cannot be built or fail their check, the
packages keep torch's ops (`registered()` is part of their keys).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
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


@functools.lru_cache(maxsize=8)
def _compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout.splitlines() or [""])[0]


def library_path(root: Path, cxx: str) -> Path:
    """Where the ops' library for this machine, source, torch and compiler lives under `root`."""
    from runtime import aoti

    desc = {"source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(), "cxx": _compiler_id(cxx), "flags": FLAGS}
    return root / f"cpu-ops-{aoti.key('cpu-ops', desc, FORMAT)}.so"


def registered() -> bool:
    """Whether this process has the ops loaded and checked (the compiled steps then call them)."""
    return _state["path"] is not None


def experts_fit(hidden: int, inter: int) -> bool:
    """Whether `moe_rows` serves experts of these widths in this process (multiples of 16)."""
    return registered() and hidden % 16 == 0 and inter % 16 == 0


def moe_rows_per_expert(h: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                        inter: int) -> torch.Tensor:
    """`moe_rows` from the packed experts' per-expert views (gu [E, H, 2I], dn [E, I, H], as the compiled steps'
    one-row inputs hold them): the views back to [H, E * 2I] and [E * I, H], no copy."""
    E, H = gu.shape[0], gu.shape[1]
    return torch.ops.strata.moe_rows(h.contiguous(), gu.permute(1, 0, 2).reshape(H, E * 2 * inter),
                                     dn.reshape(E * inter, H), idx, w.contiguous(), inter)


def ensure(root: Path, build: bool) -> str:
    """Load the ops from the store under `root` (built there first when missing or damaged and `build`): "" once
    they are registered in this process and their library is under `root`, else why not."""
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
        src = Path(_state["path"])
        # this store gets the library the process loaded elsewhere, when it is the one this source makes (a source
        # changed under a running process would otherwise put the old library under the new key)
        if build and src.name == path.name and _damaged(path):
            _place(src.read_bytes(), path)
        return ""
    why = _damaged(path)
    if why and not build:
        return why
    if why:
        try:
            _build(cxx, path)
        except Exception as exc:
            _state["failed"] = f"building the CPU ops failed ({type(exc).__name__}: {str(exc).strip()[:300]})"
            return _state["failed"]
        return ""
    try:
        _load(path)
    except Exception as exc:                     # not the ops this source makes: torch's ops serve
        _state["failed"] = f"the CPU ops library {path.name} would not load ({str(exc).strip()[:200]})"
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
        return f"the CPU ops library {path.name} is damaged (its sha256 is not the one recorded when it was built)"
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

    @torch.library.register_fake("strata::int8_head")
    def _(x, w, scale):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("strata::moe_rows")
    def _(h, gu, dn, idx, wt, inter):
        return torch.empty_like(h)

    @torch.library.register_fake("strata::int8_head_top")
    def _(x, w, scale):
        n = x.shape[0]
        return x.new_empty((n, w.shape[0])), x.new_empty((n,), dtype=torch.long), x.new_empty((n,))

    @torch.library.register_fake("strata::rows16")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0] * w.shape[2]))

    @torch.library.register_fake("strata::moe_rows8")
    def _(h, gu, gus, dn, dns, idx, wt, inter):
        return torch.empty_like(h)

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


def head_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `int8_head` computes: x rounded to integers per row (its largest magnitude to Q = min(32767,
    (2^31 - 1) // (127 H))), the integer dot products with w's rows, times the rows' scales and x's (in float64)."""
    Q = float(min(32767, (2**31 - 1) // (127 * x.shape[1])))
    sx = x.abs().amax(1, keepdim=True) / Q
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(x / sx)
    return ((xq.double() @ w.double().t()) * (scale.double()[None] * sx.double())).float()


# a block row's stored order: position j of each 64 holds output _INTERLEAVE[j] (in each 32, even positions outputs
# 0-15 and odd ones 16-31, so the op converts 32 bf16 values to floats in two bit operations)
_INTERLEAVE = torch.tensor([32 * (j // 32) + 16 * (j % 2) + (j % 32) // 2 for j in range(64)])


def blocks16(w: torch.Tensor) -> torch.Tensor:
    """w [K, N] (x @ w; N a multiple of 64) as `rows16` reads it: bf16 in blocks of 64 columns, [N / 64, K, 64],
    each block's K rows contiguous and each row's 64 values in `_INTERLEAVE` order."""
    K, N = w.shape
    b = w.detach().to(torch.bfloat16).reshape(K, N // 64, 64).transpose(0, 1)
    return b[..., _INTERLEAVE].contiguous()


def unblocks16(wb: torch.Tensor) -> torch.Tensor:
    """`blocks16`'s inverse: the [K, N] bf16 matrix."""
    w = torch.empty_like(wb)
    w[..., _INTERLEAVE] = wb
    return w.transpose(0, 1).reshape(wb.shape[1], -1)


def rows16_reference(x: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """What `rows16` computes, in float64: x @ the blocks' bf16 values."""
    return (x.double() @ unblocks16(wb).double()).float()


def head_top_reference(lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `int8_head_top` adds to its logits `lg` (`int8_head`'s): each row's first maximum and its softmax
    probability (in float64)."""
    return lg.argmax(-1), torch.softmax(lg.double(), -1).amax(-1).float()


def moe8_reference(h: torch.Tensor, gu: torch.Tensor, gus: torch.Tensor, dn: torch.Tensor, dns: torch.Tensor,
                   idx: torch.Tensor, wt: torch.Tensor, inter: int) -> torch.Tensor:
    """What `moe_rows8` computes: each row's experts through `head_reference` products (gu [E * 2I, H] and dn
    [E * H, I] int8 rows), the activation silu(gate) * up * weight quantized again for the down product."""
    H = h.shape[1]
    out = torch.zeros(h.shape, dtype=torch.float64)
    for r in range(h.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[r, j])
            g = head_reference(h[r:r + 1], gu[e * 2 * inter:(e + 1) * 2 * inter], gus[e * 2 * inter:(e + 1) * 2 * inter])
            act = torch.nn.functional.silu(g[:, :inter]) * g[:, inter:] * float(wt[r, j])
            out[r] += head_reference(act, dn[e * H:(e + 1) * H], dns[e * H:(e + 1) * H])[0].double()
    return out.float()


def moe_reference(h: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor,
                  inter: int) -> torch.Tensor:
    """What `moe_rows` computes, in float64: each row's experts in top-k order, down_e(silu(gate_e h) * up_e h *
    weight), summed (gu [H, E * 2I], dn [E * I, H])."""
    out = torch.zeros(h.shape, dtype=torch.float64)
    for r in range(h.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[r, j])
            g = h[r].double() @ gu[:, e * 2 * inter:(e + 1) * 2 * inter].double()
            act = torch.nn.functional.silu(g[:inter]) * g[inter:] * float(wt[r, j])
            out[r] += act @ dn[e * inter:(e + 1) * inter].double()
    return out.float()


def check() -> str:
    """Why the loaded ops do not compute what they should ("" when they do): the attention against `reference` on
    random inputs (the cache's last slot included) and one row's bits alone and inside a window of other rows; the
    head against `head_reference` over a row count that is not a multiple of 16; the bf16 product, the int8 head's
    top-1 and the int8 experts against theirs."""
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
    kb, vb = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    if not torch.equal(torch.ops.strata.window_attention(q, kb, vb, seen, grp),
                       torch.ops.strata.window_attention(q, kb.float(), vb.float(), seen, grp)):
        return "the attention op reads a bf16 cache other than as the floats it holds"
    w = torch.randint(-127, 128, (37, 128), generator=gen, dtype=torch.int8)
    scale = torch.rand(37, generator=gen) / 100
    x = torch.randn(2, 128, generator=gen)
    got, want = torch.ops.strata.int8_head(x, w, scale), head_reference(x, w, scale)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return f"the int8 head op is off by {float((got - want).abs().max()):.1e} from its integer reference"
    E, inter, H = 4, 32, 64
    gu, dn = torch.randn(H, E * 2 * inter, generator=gen) / 8, torch.randn(E * inter, H, generator=gen) / 8
    h = torch.randn(3, H, generator=gen)
    idx, wt = torch.tensor([[2, 0], [3, 1], [0, 3]]), torch.rand(3, 2, generator=gen)
    got, want = torch.ops.strata.moe_rows(h, gu, dn, idx, wt, inter), moe_reference(h, gu, dn, idx, wt, inter)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        return f"the experts op is off by {float((got - want).abs().max()):.1e} from float64"
    alone = torch.ops.strata.moe_rows(h[1:2], gu, dn, idx[1:2], wt[1:2], inter)
    if not torch.equal(alone, got[1:2]):
        return "the experts op gives a row other bits inside a window than alone"
    wb = blocks16(torch.randn(96, 128, generator=gen))
    xs = torch.randn(5, 96, generator=gen)
    got = torch.ops.strata.rows16(xs, wb)
    if not torch.allclose(got, rows16_reference(xs, wb), rtol=1e-5, atol=1e-4):
        return "the bf16 product is off from float64"
    if not torch.equal(torch.ops.strata.rows16(xs[4:5], wb), got[4:5]):
        return "the bf16 product gives a row other bits inside a window than alone"
    got = torch.ops.strata.moe_rows(h, gu.bfloat16(), dn.bfloat16(), idx, wt, inter)
    want = moe_reference(h, gu.bfloat16().float(), dn.bfloat16().float(), idx, wt, inter)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        return f"the experts op with bf16 weights is off by {float((got - want).abs().max()):.1e} from float64"
    lg, tok, conf = torch.ops.strata.int8_head_top(x, w, scale)
    want = head_top_reference(lg)
    if not (torch.equal(lg, torch.ops.strata.int8_head(x, w, scale)) and torch.equal(tok, want[0])
            and torch.allclose(conf, want[1], rtol=1e-5, atol=1e-7)):
        return "the int8 head's token or probability is not its logits' first maximum and its probability"
    gu8 = torch.randint(-127, 128, (E * 2 * inter, H), generator=gen, dtype=torch.int8)
    dn8 = torch.randint(-127, 128, (E * H, inter), generator=gen, dtype=torch.int8)
    gus, dns = torch.rand(E * 2 * inter, generator=gen) / 500, torch.rand(E * H, generator=gen) / 500
    got = torch.ops.strata.moe_rows8(h, gu8, gus, dn8, dns, idx, wt, inter)
    want = moe8_reference(h, gu8, gus, dn8, dns, idx, wt, inter)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return f"the int8 experts op is off by {float((got - want).abs().max()):.1e} from its integer reference"
    return ""
