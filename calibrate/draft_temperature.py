"""How hot the MTP drafter should sample: the draft temperature scale calibration writes to `[speculative]`.

Sampled speculation accepts a proposal drawn from q with probability min(1, p / q), so a window's first proposal is
accepted with probability sum_x min(p(x), q(x)) (p: the target's distribution after temperature, top-k, top-p; q:
the drafter's). Any q keeps the output distributed as the target's (runtime/speculative.py uses the q each proposal
was drawn from), so the drafter may sample at another temperature than the request's; a head trained to put its
mass on the target's greedy token is more confident than the target and overlaps it more when drawn hotter
(docs/models.md, "Draft temperature"). This measures that overlap teacher-forced on the calibration prompts, for
the first MTP step (one forward of the target and one of the head over each prompt, no decoding), at a few scales
and sampling settings, and picks the scale with the largest mean overlap.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from runtime.sampling import SamplingParams, probs

SCALES = (1.0, 1.25, 1.5, 1.75, 2.0)
# (temperature, top_p) the overlap is averaged over: a chat default and plain sampling
SETTINGS = ((0.7, 0.9), (1.0, 1.0))
MAX_TOKENS = 512          # of each prompt (the logits of a large vocabulary take [tokens, vocab] floats)
ROWS = 128                # rows of logits turned into distributions at a time
MIN_GAIN = 0.01           # a scale must beat 1 by this much of the mean overlap to be chosen
NEAR = 0.005              # scales this close to the best count as the best: the one nearest 1 is taken


def overlap(target_logits: torch.Tensor, draft_logits: torch.Tensor, scales=SCALES, settings=SETTINGS
            ) -> dict[float, list[float]]:
    """Per scale, per setting: sum_x min(p, q) summed over the rows (fp32; p from the target's logits, q from the
    draft's at the setting's temperature times the scale, both with the setting's top-p)."""
    out = {s: [0.0] * len(settings) for s in scales}
    for r in range(0, target_logits.shape[0], ROWS):
        t, d = target_logits[r: r + ROWS].float(), draft_logits[r: r + ROWS].float()
        for j, (temp, top_p) in enumerate(settings):
            p = probs(t, SamplingParams(temperature=temp, top_p=top_p))
            for s in scales:
                q = probs(d, SamplingParams(temperature=temp * s, top_p=top_p))
                out[s][j] += float(torch.minimum(p, q).sum())
    return out


def measure(engine: Any, token_lists: list[list[int]], *, max_tokens: int = MAX_TOKENS,
            max_seconds: float | None = None) -> dict[str, Any]:
    """{"scale", "overlap" (mean per scale), "by_setting", "rows", "prompts", "seconds"} for an MTP engine, or
    {"scale": 1.0, "why_not"} where it cannot be measured (another drafter, no head, nothing long enough).
    `max_seconds`: no further prompt is started once this much time has gone (a large model on a slow machine; the
    first prompt always runs)."""
    t0 = time.perf_counter()
    model = getattr(engine, "model", None)
    if getattr(engine, "drafter_kind", None) != "mtp" or getattr(model, "mtp", None) is None:
        return {"scale": 1.0, "why_not": "measured for the MTP drafter only"}
    dev = next(model.parameters()).device
    sums = {s: [0.0] * len(SETTINGS) for s in SCALES}
    rows = used = 0
    with torch.no_grad():
        for ids in token_lists:
            ids = ids[:max_tokens]
            if len(ids) < 3:
                continue
            if used and max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
            x = torch.tensor(ids, dtype=torch.long, device=dev)[None]
            out = model(x)
            # target row p predicts x[p + 1]; the head's row p - 1 is its step at position p, predicting the same
            got = overlap(out.logits[0, 1:], model.mtp_logits(x, out.hidden)[0])
            for s in SCALES:
                sums[s] = [a + b for a, b in zip(sums[s], got[s], strict=True)]
            rows += len(ids) - 1
            used += 1
    if rows == 0:
        return {"scale": 1.0, "why_not": "no calibration prompt is long enough"}
    mean = {s: sum(v) / (rows * len(SETTINGS)) for s, v in sums.items()}
    top = max(mean.values())
    best = min((s for s in SCALES if mean[s] >= top - NEAR), key=lambda s: abs(s - 1.0))
    if mean[best] < mean[1.0] + MIN_GAIN:
        best = 1.0
    return {"scale": best, "overlap": {str(s): round(v, 4) for s, v in mean.items()},
            "by_setting": {f"T{t}/top_p{tp}": {str(s): round(sums[s][j] / rows, 4) for s in SCALES}
                           for j, (t, tp) in enumerate(SETTINGS)},
            "rows": rows, "prompts": used, "seconds": round(time.perf_counter() - t0, 3)}
