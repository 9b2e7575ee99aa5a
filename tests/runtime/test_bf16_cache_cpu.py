"""A bf16 KV cache on a CPU (`[memory] kv_dtype = "bf16"` beside fp32 weights) runs through the compiled steps, the
target's and the MTP chain's, not the eager ones, and greedy speculation still equals the target alone."""

from __future__ import annotations

import shutil

import pytest
import torch

from bench.common import NANO, task_prompts
from runtime import target_compiled
from runtime.drafters import mtp_compiled
from runtime.engine import Engine
from tests.runtime.tiny import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the compiled steps cannot be built here (the eager steps serve)")
    mp = pytest.MonkeyPatch()
    mp.setenv("STRATA_COMPILE", "1")
    mp.setenv("STRATA_HOME", str(tmp_path_factory.mktemp("home")))
    torch.set_num_threads(1)
    eng = Engine.build(NANO, "mtp", device="cpu", context=512, block=4, spec_min_p=0.0, kv_dtype="bf16")
    yield eng
    mp.undo()


def test_both_steps_compile_for_a_bf16_cache(built):
    eng = built
    assert eng.kv.k.dtype == torch.bfloat16 and eng.drafter.kv.k.dtype == torch.bfloat16
    assert eng.model.model.norm.weight.dtype == torch.float32
    assert target_compiled.fits(eng.model, eng.kv) is None and mtp_compiled.fits(eng.drafter) is None
    assert eng.compile_target(build=True) == "" and eng.compile_drafter(build=True) == ""
    # the chain keeps its int8 products and the attention op with a bf16 cache
    assert mtp_compiled.dense8(eng.drafter) and mtp_compiled.attn_op(eng.drafter)
    # a package names the cache's dtype: an fp32 cache's package is another file
    assert target_compiled.shape_of(eng.model, eng.kv, "wide", ())["kv"] == "torch.bfloat16"
    assert mtp_compiled.shape_of(eng.drafter)["kv"] == "torch.bfloat16"


def test_greedy_speculation_equals_the_target_alone(built):
    eng = built
    if not eng.target_packages:
        assert eng.compile_target(build=True) == "" and eng.compile_drafter(build=True) == ""
    p = task_prompts()["code"]
    alone = eng.generate(p, max_new_tokens=40, draft=False, width=4)
    spec = eng.generate(p, max_new_tokens=40, draft=True, width=4)
    assert alone.stats["target_compiled"] and spec.stats["target_compiled"] and eng.drafter_compiled
    assert spec.stats["accepted"] > 0
    assert spec.token_ids == alone.token_ids
