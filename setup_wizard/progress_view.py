"""Progress bars on stderr for the pipeline's progress callbacks (runtime/progress.py): one bar per label."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from runtime.progress import ProgressFn


class _Amount(ProgressColumn):
    """`done/total` in the bar's unit: bytes as kB/MB/GB, counts as they are."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "")
        fmt = decimal if unit == "B" else (lambda n: f"{int(n)}")
        total = "?" if task.total is None else fmt(int(task.total))
        return Text(f"{fmt(int(task.completed))}/{total}", style="progress.download")


@contextmanager
def progress_bars(console: Console | None = None, *, enabled: bool = True) -> Iterator[ProgressFn]:
    """Yields a progress callback that draws a bar per label while the block runs (or draws nothing)."""
    if not enabled:
        yield lambda label, done, total, unit="": None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), _Amount(), TimeElapsedColumn(),
                  console=console or Console(stderr=True), transient=False) as bars:
        tasks: dict[str, object] = {}

        def on_progress(label: str, done: float, total: float | None, unit: str = "") -> None:
            head, _, detail = label.partition(": ")
            if head not in tasks:
                tasks[head] = bars.add_task(head, total=total, completed=done, unit=unit)
            bars.update(tasks[head], completed=done, total=total,
                        description=f"{head}: {detail}" if detail else head)

        yield on_progress
