"""Progress of long steps (downloads, conversions, calibration), reported through a plain callback.

Pipeline functions call `on_progress(label, done, total, unit)` and know nothing about consoles; the command line
turns the calls into progress bars (setup_wizard/progress_view.py), and scripts and tests pass nothing or a recorder.
One label is one bar; `done` and `total` count `unit`s ("B" for bytes, "" for plain counts); `total` None = unknown.
"""

from __future__ import annotations

from typing import Protocol


class ProgressFn(Protocol):
    def __call__(self, label: str, done: float, total: float | None, unit: str = "") -> None: ...
