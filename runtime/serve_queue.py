"""One engine, one worker thread: requests wait in a bounded queue and are generated one at a time (the engine
holds one KV cache and is not thread-safe). Stop strings are cut here, as OpenAI cuts them, and a job whose client
left, or whose stop string appeared, stops at the next window (docs/commands.md, strata-serve)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.sampling import SamplingParams

__all__ = ["Job", "Outcome", "QueueFullError", "ShuttingDownError", "StopText", "Worker"]


class QueueFullError(RuntimeError):
    """Every queue place is taken (the server answers 503)."""


class ShuttingDownError(RuntimeError):
    """The server is stopping and takes no new work (503)."""


class StopText:
    """Cuts streamed text at the first occurrence of any stop string. Text that could be the start of a stop
    string is held back until the next piece decides it, so no stop text is ever emitted."""

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.held = ""
        self.hit: str | None = None

    def push(self, piece: str) -> str:
        if self.hit is not None:
            return ""
        if not self.stops:
            return piece
        return self._scan(self.held + piece, final=False)

    def flush(self) -> str:
        """The held-back tail at the end of generation (what of it comes before any stop string)."""
        if self.hit is not None or not self.held:
            self.held = ""
            return ""
        return self._scan(self.held, final=True)

    def _scan(self, buf: str, *, final: bool) -> str:
        """Emit `buf` up to the first stop string, or up to where one may still be starting (held back)."""
        full = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        first, stop = min(full) if full else (len(buf), None)
        pending = len(buf)          # earliest start of a stop string the text so far could still complete
        if not final:
            for s in self.stops:
                for j in range(max(0, len(buf) - len(s) + 1), len(buf)):
                    if s.startswith(buf[j:]):
                        pending = min(pending, j)
                        break
        if stop is not None and first <= pending:
            self.hit, self.held = stop, ""
            return buf[:first]
        self.held = buf[pending:]
        return buf[:pending]


@dataclass
class Outcome:
    text: str
    token_ids: list[int]
    finish_reason: str            # stop | length | cancelled
    stats: dict[str, Any]
    queue_s: float


Sink = Callable[[str, Any], None]   # ("text", str) | ("done", Outcome) | ("error", Exception), on the worker thread


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    sink: Sink
    stop: list[str] = field(default_factory=list)
    client_gone: Callable[[], bool] = lambda: False
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.client_gone()


class Worker:
    """Runs jobs on `engine` in arrival order. At most `max_queue` jobs wait behind the running one."""

    def __init__(self, engine: Any, max_queue: int = 16) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}.")
        self.engine, self.max_queue = engine, max_queue
        self._q: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._admitted: list[Job] = []      # waiting or running
        self._running: Job | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="strata-serve-worker", daemon=True)

    # ------------------------------------------------------------------------------------------------ control
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closing:
                raise ShuttingDownError("the server is shutting down; retry on its next start.")
            if len(self._admitted) > self.max_queue:
                raise QueueFullError(f"the server is busy: its queue is full ({self.max_queue} waiting behind the "
                                     f"one being generated, --max-queue); retry shortly.")
            self._admitted.append(job)
        self._q.put(job)

    def cancel_all(self) -> None:
        """Refuse new work and stop what is admitted (the running job at its next window)."""
        with self._lock:
            self._closing = True
            for job in self._admitted:
                job.cancelled.set()

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel everything and wait for the thread; True when it has exited."""
        self.cancel_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def waiting(self) -> int:
        """Admitted jobs behind the running one whose client is still there (one that left or was cancelled is
        dropped when its turn comes, without reaching the engine)."""
        with self._lock:
            return sum(1 for j in self._admitted if j is not self._running and not j.should_stop())

    @property
    def running(self) -> bool:
        return self._running is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=0.1)
            except queue.Empty:
                if self._closing:
                    return
                continue
            with self._lock:
                self._running = job
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self._running = None
                    self._admitted.remove(job)

    def _serve(self, job: Job) -> None:
        started = time.perf_counter()
        queue_s = started - job.enqueued_at
        if job.should_stop():       # cancelled while it waited: never reaches the engine
            job.sink("done", Outcome("", [], "cancelled", {}, queue_s))
            return
        cut = StopText(job.stop)
        parts: list[str] = []

        def on_text(piece: str) -> None:
            out = cut.push(piece)
            if out:
                parts.append(out)
                job.sink("text", out)

        try:
            res = self.engine.generate(job.prompt_ids, max_new_tokens=job.max_tokens, sampling=job.sampling,
                                       on_text=on_text, cancel=lambda: cut.hit is not None or job.should_stop())
        except Exception as e:  # handed to the request: one sentence in its response
            job.sink("error", e)
            return
        if tail := cut.flush():
            parts.append(tail)
            job.sink("text", tail)
        stats = dict(res.stats)
        if cut.hit is not None:
            stats["stop_reason"] = "stop_string"
        reason = stats.get("stop_reason", "length")
        if reason in ("stop", "stop_string"):
            finish = "stop"
        elif reason == "cancelled":
            finish = "cancelled"
        else:
            finish = "length"           # max_tokens reached, or the context is full
        job.sink("done", Outcome("".join(parts), list(res.token_ids), finish, stats, queue_s))
