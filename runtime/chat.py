"""`strata-run --chat`: a conversation in the terminal through the model's chat template (runtime/chat_template.py).
Ctrl-C stops the answer being written (the engine stops at its next window) and keeps the conversation; Ctrl-D or
/exit ends it; /clear forgets it (docs/commands.md, strata-serve)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from runtime.chat_template import ChatTemplate
from runtime.errors import UsageError
from runtime.sampling import SamplingParams

__all__ = ["ChatSession", "chat_loop"]

HELP = "/exit (or Ctrl-D) ends, /clear forgets the conversation, Ctrl-C stops an answer."
EXIT_WORDS = ("/exit", "/quit", "/bye")


class ChatSession:
    """The history and the turn: render, fit the context (oldest turns go first), generate."""

    def __init__(self, engine: Any, template: ChatTemplate, *, system: str | None = None,
                 max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                 **generate_kwargs: Any) -> None:
        """`generate_kwargs` go to every `engine.generate` (block, spec_min_p, draft)."""
        self.engine, self.template, self.generate_kwargs = engine, template, generate_kwargs
        self.system = system
        self.max_new_tokens, self.sampling = max_new_tokens, sampling or SamplingParams()
        self.messages: list[dict[str, str]] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=True)
        return self.template.encode(self.engine.tokenizer, text)

    def fit(self) -> list[int]:
        """Token ids of the conversation, dropping the oldest exchanges until it leaves room to answer (a message
        too long on its own is refused and the history kept)."""
        ctx = int(self.engine.context)
        first = 1 if self.system else 0
        alone = self._prompt_ids(self.messages[:first] + self.messages[-1:])
        if len(alone) + 1 > ctx:
            raise UsageError(f"that message is {len(alone)} tokens with the template, more than the context of "
                             f"{ctx} holds; send a shorter one.")
        ids = self._prompt_ids(self.messages)
        while len(ids) + 1 > ctx and len(self.messages) - first > 1:
            del self.messages[first]
            while len(self.messages) - first > 1 and self.messages[first]["role"] != "user":
                del self.messages[first]
            ids = self._prompt_ids(self.messages)
        return ids

    def turn(self, text: str, on_text: Callable[[str], None], cancel: Callable[[], bool]):
        """Add the user's text, answer it (streamed through `on_text`), and keep the answer, even a stopped one."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.fit()
        except ValueError:
            self.messages.pop()
            raise
        room = int(self.engine.context) - len(ids)
        limit = room if self.max_new_tokens is None else min(self.max_new_tokens, room)
        res = self.engine.generate(ids, max_new_tokens=limit, sampling=self.sampling, on_text=on_text,
                                   cancel=cancel, **self.generate_kwargs)
        self.messages.append({"role": "assistant", "content": res.text})
        return res


def chat_loop(session: ChatSession, *, read: Callable[[str], str] = input, out: TextIO | None = None,
              err: TextIO | None = None, report: Callable[[dict], str] | None = None, title: str = "") -> int:
    """Read a line, answer it, until Ctrl-D or /exit. Returns the exit code (0)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        import readline  # noqa: F401  (line editing and ↑ history for input(), where the platform has it)
    except ImportError:
        pass
    err.write(f"Chatting with {title or 'the model'}. {HELP}\n")
    err.flush()
    stop = threading.Event()
    main_thread = threading.current_thread() is threading.main_thread()
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            err.write("\n(use /exit or Ctrl-D to leave)\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in EXIT_WORDS:
            return 0
        if text == "/clear":
            session.clear()
            err.write("(conversation cleared)\n")
            continue
        if text in ("/help", "/?"):
            err.write(HELP + "\n")
            continue
        stop.clear()
        previous = signal.signal(signal.SIGINT, lambda s, f: stop.set()) if main_thread else None

        def write(piece: str) -> None:
            out.write(piece)
            out.flush()

        try:
            res = session.turn(text, write, stop.is_set)
        except ValueError as e:
            err.write(f"{e}\n")
            continue
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)
        out.write("\n")
        if res.stats.get("stop_reason") == "cancelled":
            err.write("(answer stopped)\n")
        if report is not None:
            err.write(report(res.stats) + "\n")
        err.flush()
