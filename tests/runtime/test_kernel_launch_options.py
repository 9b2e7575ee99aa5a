"""Every Triton launch in the runtime names its FMA contraction (runtime/gpu/kernels.py `FMA`): Triton 3.9 warns on
each process's first compile that its default turns off in 3.10, and a kernel left on the default would then change
its arithmetic (and its bits) with the Triton version. Read from the source: the interpreter, which runs the kernels
on CPU, drops launch options."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "runtime" / "gpu"


def _jit_names(tree: ast.Module) -> set[str]:
    """Functions of the module decorated with triton.jit (bare or called)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                if isinstance(f, ast.Attribute) and f.attr == "jit":
                    out.add(node.name)
    return out


def _names_fma(kw: ast.keyword, launch_vars: set[str]) -> bool:
    """A launch keyword that carries the option: enable_fp_fusion=..., **FMA, **kernels.FMA, **pdl.launch(...) (its
    dicts include FMA) or **name where name = pdl.launch(...)."""
    if kw.arg == "enable_fp_fusion":
        return True
    if kw.arg is not None:
        return False
    v = kw.value
    if isinstance(v, ast.Name):
        return v.id == "FMA" or v.id in launch_vars
    if isinstance(v, ast.Attribute):
        return v.attr == "FMA"
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute):
        return v.func.attr == "launch" and isinstance(v.func.value, ast.Name) and v.func.value.id == "pdl"
    return False


def _launch_vars(tree: ast.Module) -> set[str]:
    """Names assigned from pdl.launch(...) (also in a conditional expression) or a dict literal with **FMA."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            vals = [node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp) else [node.value]
            if any(isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "launch"
                   or isinstance(v, ast.Dict) and any(k is None and isinstance(x, ast.Name) and x.id == "FMA"
                                                      for k, x in zip(v.keys, v.values, strict=True))
                   for v in vals):
                out.add(node.targets[0].id)
    return out


def launches_without_fma(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    jit, launch_vars = _jit_names(tree), _launch_vars(tree)
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Subscript) and isinstance(f.value, ast.Name) and f.value.id in jit:
            name = f.value.id
        elif isinstance(f, ast.Attribute) and f.attr == "warmup" and isinstance(f.value, ast.Name) \
                and f.value.id in jit:
            name = f.value.id + ".warmup"
        else:
            continue
        if not any(_names_fma(kw, launch_vars) for kw in node.keywords):
            bad.append(f"{path.name}:{node.lineno} {name}")
    return bad


def test_every_launch_names_its_fma_contraction():
    files = sorted(GPU.glob("*.py"))
    assert len(files) > 5
    bad = [b for p in files for b in launches_without_fma(p)]
    assert bad == [], f"launches on Triton's default FMA contraction: {bad}"


def test_the_check_sees_a_launch_that_leaves_it_out(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("import triton\n@triton.jit\ndef _k(x, GDC: tl.constexpr):\n    pass\n"
                   "def go(x):\n    _k[(1,)](x, **pdl.launch(x))\n    _k[(1,)](x, GDC=False)\n"
                   "    _k[(1,)](x, GDC=False, **FMA)\n    _k.warmup(x, grid=(1,))\n")
    assert launches_without_fma(src) == ["k.py:7 _k", "k.py:9 _k.warmup"]


def test_pdl_launch_options_carry_it():
    pytest.importorskip("triton")
    from runtime.gpu import pdl
    from runtime.gpu.kernels import FMA

    for opts in (pdl._OFF, pdl._ON, pdl._ON_FIRST):
        assert opts["enable_fp_fusion"] is FMA["enable_fp_fusion"] is True
