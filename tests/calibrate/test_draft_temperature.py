"""The draft temperature measurement (calibrate/draft_temperature.py): the overlap it computes, the scale it picks,
and that calibration's choice reaches the config."""

from __future__ import annotations

import pytest
import torch

from calibrate import draft_temperature as D
from calibrate.results import CalibrationResult
from runtime.sampling import SamplingParams, probs
from setup_wizard.steps import apply_calibration


def test_overlap_is_sum_of_minima_per_row():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(5, 40, generator=g) * 3
    d = torch.randn(5, 40, generator=g) * 3
    got = D.overlap(t, d, scales=(1.0, 1.5), settings=((0.7, 0.9),))
    for s in (1.0, 1.5):
        p = probs(t, SamplingParams(temperature=0.7, top_p=0.9))
        q = probs(d, SamplingParams(temperature=0.7 * s, top_p=0.9))
        want = sum(float(torch.minimum(p[i], q[i]).sum()) for i in range(5))
        assert got[s][0] == pytest.approx(want, rel=1e-5)
    same = D.overlap(t, t, scales=(1.0,), settings=((0.7, 0.9), (1.0, 1.0)))
    assert same[1.0] == pytest.approx([5.0, 5.0], rel=1e-5)          # q == p: every proposal accepted


class _Model(torch.nn.Module):
    """A target and an MTP head whose logits are the target's times `sharp`: drawn at `sharp` times the temperature
    the head is the target's distribution exactly."""

    def __init__(self, sharp: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(50, 30, generator=torch.Generator().manual_seed(1)) * 2)
        self.sharp, self.mtp = sharp, True

    def forward(self, x):
        lg = self.w[x]
        return type("O", (), {"logits": lg, "hidden": lg})()

    def mtp_logits(self, x, hidden):
        return self.sharp * self.w[x[:, 1:]]


class _Engine:
    def __init__(self, sharp: float, kind: str = "mtp") -> None:
        self.model, self.drafter_kind = _Model(sharp), kind


@pytest.mark.parametrize("sharp, scale", [(2.0, 2.0), (1.5, 1.5), (1.0, 1.0), (0.5, 1.0)])
def test_measure_picks_the_scale_that_undoes_an_overconfident_head(sharp, scale):
    # the head's row p - 1 and the target's row p read the same token's logits: q is p sharpened by `sharp`
    res = D.measure(_Engine(sharp), [list(range(0, 20)), list(range(10, 40))])
    assert res["scale"] == scale, res
    assert res["rows"] == 19 + 29
    assert res["overlap"][str(scale)] == max(res["overlap"].values()) or scale == 1.0


def test_measure_stops_starting_prompts_after_its_time(monkeypatch):
    import time as _time

    eng = _Engine(2.0)
    real = eng.model.forward

    def slow(x):
        _time.sleep(0.05)
        return real(x)

    monkeypatch.setattr(eng.model, "forward", slow)
    prompts = [list(range(0, 20)), list(range(10, 40)), list(range(5, 30))]
    cut = D.measure(eng, prompts, max_seconds=0.01)
    assert cut["prompts"] == 1 and cut["rows"] == 19 and cut["scale"] == 2.0      # the first prompt always runs
    assert D.measure(eng, prompts)["prompts"] == 3


def test_measure_says_why_not_for_other_drafters_and_short_prompts():
    assert D.measure(_Engine(2.0, "dflash2"), [[1, 2, 3, 4]]) == {"scale": 1.0,
                                                                  "why_not": "measured for the MTP drafter only"}
    assert D.measure(_Engine(2.0), [[1, 2]])["why_not"] == "no calibration prompt is long enough"


def test_calibrated_scale_reaches_the_config_and_old_records_leave_it_out():
    rec = {"settings": {"block": 4, "spec_min_p": 0.5}, "source": "calibrated", "decision": "winner",
           "draft_temperature": {"scale": 1.5, "overlap": {"1.0": 0.6, "1.5": 0.67}}}
    doc = {"drafter": {"kind": "mtp"}, "speculative": {"block": 3, "spec_min_p": 0.3, "source": "default"}}
    apply_calibration(doc, CalibrationResult.from_record(None, rec, reused=False, path=None))
    assert doc["speculative"] == {"block": 4, "spec_min_p": 0.5, "source": "calibrated", "draft_temp_scale": 1.5}
    assert doc["calibration"]["draft_temp_scale"] == 1.5
    del rec["draft_temperature"]
    doc = {"drafter": {"kind": "mtp"}}
    apply_calibration(doc, CalibrationResult.from_record(None, rec, reused=True, path=None))
    assert "draft_temp_scale" not in doc["speculative"] and "draft_temp_scale" not in doc["calibration"]
