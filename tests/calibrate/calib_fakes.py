"""Deterministic fakes for the calibration tests: an engine whose decode speed is a known function of the
settings, and a clock that advances only when the fake engine 'works'."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

TASKS = ("code", "math", "prose", "long")
TASK_SCALE = {"code": 1.0, "math": 1.2, "prose": 0.8, "long": 0.9}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def bowl_speed(best_block: int = 5, best_p: float = 0.3, peak: float = 100.0):
    """tok/s = peak at (best_block, best_p), falling off smoothly in both directions (one maximum)."""
    def speed(block: int, p: float, task: str) -> float:
        return peak * TASK_SCALE[task] * math.exp(-0.05 * (block - best_block) ** 2 - 2.0 * (p - best_p) ** 2)
    return speed


class FakeTokenizer:
    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[ord(c) % 97 for c in text])


@dataclass
class FakeEngine:
    """`generate` returns the same greedy ids for every arm (unless told to break one) and advances the clock by
    new_tokens / speed (+ a fixed prefill cost)."""

    speed: Any
    clock: FakeClock
    max_block: int = 8
    target_speed: float = 40.0
    prefill_s: float = 0.01
    broken: tuple[int, float, str] | None = None     # (block, floor, task) whose output is corrupted
    noise: float = 0.0                               # deterministic +- jitter on each call (fraction)
    calls: list[tuple] = field(default_factory=list)
    tokenizer: Any = field(default_factory=FakeTokenizer)
    default_block: int = 4
    default_spec_min_p: float = 0.5
    slow_after: int | None = None                    # calls after which every run is `slowdown` times slower
    slowdown: float = 1.0
    cancelled: int = 0

    @property
    def drafter(self) -> SimpleNamespace:
        return SimpleNamespace(max_block=self.max_block, kind="dflash2")

    def generate(self, prompt, max_new_tokens=128, sampling=None, block=None, spec_min_p=None, draft=True,
                 stop_ids=None, on_text=None, cancel=None):
        task = self._task(prompt)
        self.calls.append((task, block, spec_min_p, draft))
        tok_s = self.target_speed * TASK_SCALE[task] if not draft else self.speed(block, spec_min_p, task)
        if self.noise:
            tok_s *= 1.0 + self.noise * math.sin(len(self.calls) * 12.9898)
        if self.slow_after is not None and len(self.calls) > self.slow_after:
            tok_s /= self.slowdown       # the machine got busy: every estimate made so far is now wrong
        decode_s = max_new_tokens / tok_s
        self.clock.advance(self.prefill_s)
        if cancel is not None:           # asked before every window (2 tokens here), as the engine does
            for _ in range(0, max_new_tokens, 2):
                if cancel():
                    self.cancelled += 1
                    return SimpleNamespace(token_ids=[], text="", stats={"stop_reason": "cancelled",
                                                                         "decode_s": 0.0, "decode_tok_s": 0.0})
                self.clock.advance(2 / tok_s)
        else:
            self.clock.advance(decode_s)
        ids = [(len(prompt) * 7 + i * 13) % 50 for i in range(max_new_tokens)]
        if draft and self.broken == (block, spec_min_p, task):
            ids[3] += 1
        proposed = 0 if not draft else max_new_tokens
        stats = {"decode_s": decode_s, "decode_tok_s": tok_s, "proposed": proposed,
                 "accepted": proposed // 2, "windows": max_new_tokens // 2, "generated_tokens": max_new_tokens}
        return SimpleNamespace(token_ids=ids, stats=stats, text="")

    def _task(self, prompt) -> str:
        n = len(prompt)
        return TASKS[n % 4] if n < 4 else {10: "code", 11: "math", 12: "prose", 13: "long"}.get(n, TASKS[n % 4])


FAKE_PROMPTS = {"code": "c" * 10, "math": "m" * 11, "prose": "p" * 12, "long": "l" * 13}


@dataclass
class WidthFakeEngine(FakeEngine):
    """A GPU-like fake: `generate(width=...)` runs the target's fixed step at `width` rows, which costs
    `step_cost(width)` times the width-1 step, and whose greedy ids differ from width 1's from token 5 on for the
    widths in `flips` (BF16 near-ties rounding differently); drafted runs return their width's ids."""

    step_cost: Any = None
    flips: tuple[int, ...] = ()
    device: Any = field(default_factory=lambda: SimpleNamespace(type="cuda"))
    widths_seen: list[tuple[bool, int]] = field(default_factory=list)

    def generate(self, prompt, max_new_tokens=128, sampling=None, block=None, spec_min_p=None, draft=True,
                 stop_ids=None, on_text=None, width=None, cancel=None):
        w = int(width if width is not None else (block if draft else 1))
        self.widths_seen.append((draft, w))
        res = super().generate(prompt, max_new_tokens, sampling, block, spec_min_p, draft, stop_ids, on_text,
                               cancel=cancel)
        if res.stats.get("stop_reason") == "cancelled":
            return res
        if not draft and self.step_cost is not None:
            extra = res.stats["decode_s"] * (self.step_cost(w) - 1.0)
            self.clock.advance(extra)
            res.stats["decode_s"] += extra
            res.stats["decode_tok_s"] = max_new_tokens / res.stats["decode_s"]
        if w in self.flips:
            res.token_ids = res.token_ids[:5] + [(t + 1) % 50 for t in res.token_ids[5:]]
        return res
