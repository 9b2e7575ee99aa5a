"""The routing profile calibration records for an offloaded setup (calibrate/routing.py): counted by a real engine on
CPU over the calibration prompts, stored under its own key beside the calibration records, reused, and handed to the
config; a setup that keeps every expert on the GPU records none."""

from __future__ import annotations

import pytest
import torch

from calibrate.api import calibrate_for_config
from calibrate.routing import PROFILE_NEW_TOKENS, offloads
from runtime.routing_profile import RoutingProfile
from tests.runtime.tiny import make_tiny_target

PROMPTS = {"code": "def add(a, b): return a + b", "prose": "The quick brown fox jumps over the lazy dog."}


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def config(target, slots: int | None) -> dict:
    mem = {"context": 256, "total_experts": 12}
    if slots is not None:
        mem["expert_cache_slots"] = slots
    return {"schema": 1, "target": {"path": str(target), "sha256": "1" * 64}, "drafter": {"kind": "none"},
            "memory": mem, "device": {"type": "cpu"}}


def test_offloaded_setup_records_stores_and_reuses_its_profile(tmp_path):
    target = make_tiny_target(tmp_path, mtp=False, experts=4, top_k=2, layers=3)
    doc = config(target, 5)
    assert offloads(doc) and not offloads(config(target, 12)) and not offloads(config(target, None))
    res = calibrate_for_config(doc, store_dir=tmp_path / "store", prompts=PROMPTS)
    assert res.decision == "nothing_to_calibrate" and res.routing_profile
    prof = RoutingProfile.load(res.routing_profile)
    assert prof.layers == [0, 1, 2] and prof.n_experts == 4
    assert prof.meta["key"]["target_sha256"] == "1" * 64
    tokens = prof.tokens
    assert tokens > len(PROMPTS) * PROFILE_NEW_TOKENS                   # prefill rows and decoded rows
    assert all(sum(row) == tokens * 2 for row in prof.counts)           # every (token, choice) counted once
    before = prof.counts
    again = calibrate_for_config(doc, store_dir=tmp_path / "store", prompts=PROMPTS)
    assert again.routing_profile == res.routing_profile
    assert RoutingProfile.load(again.routing_profile).counts == before
    assert res.to_dict()["routing_profile"] == res.routing_profile


def test_all_resident_setup_records_nothing(tmp_path):
    target = make_tiny_target(tmp_path, mtp=False, experts=4, top_k=2, layers=3)
    res = calibrate_for_config(config(target, 12), store_dir=tmp_path / "store", prompts=PROMPTS)
    assert res.decision == "nothing_to_calibrate" and res.routing_profile is None
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").glob("routing-*.json"))
