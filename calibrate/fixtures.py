"""The project's fixed calibration prompts (code, math, prose, long) and how they become token ids.

The prompts are text files in `calibrate/prompts/`, Python-flavoured because the bundled pack's tokenizer is a
byte-level BPE trained on Python source; `long` is a ~9 KB module plus a task (about 3k tokens with that
tokenizer, so it exercises a context of more than 2k tokens). Every task generates the same fixed number of
new tokens. A prompt that does not fit the configured context keeps its tail (where the task is).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import UsageError

TASKS: tuple[str, ...] = ("code", "math", "prose", "long")
NEW_TOKENS = 96
LONG_MIN_TOKENS = 2048


def load_prompts() -> dict[str, str]:
    """The four shipped prompt texts, by task."""
    base = Path(__file__).resolve().parent / "prompts"   # package data, installed beside this module
    return {t: (base / f"{t}.txt").read_text(encoding="utf-8") for t in TASKS}


def prompt_set_sha256(prompts: dict[str, str]) -> str:
    h = hashlib.sha256()
    for t in sorted(prompts):
        h.update(t.encode() + b"\0" + prompts[t].encode() + b"\0")
    return h.hexdigest()


@dataclass
class EncodedPrompt:
    task: str
    ids: list[int]
    full_tokens: int        # tokens before any truncation

    @property
    def truncated(self) -> bool:
        return len(self.ids) < self.full_tokens


def encode_prompts(tokenizer: Any, prompts: dict[str, str], *, context: int | None, new_tokens: int,
                   max_block: int) -> dict[str, EncodedPrompt]:
    """Token ids per task, each cut (keeping its tail) to fit `context` with the new tokens and a full window."""
    limit = None if not context else context - new_tokens - max_block - 1
    if limit is not None and limit < 8:
        raise UsageError(f"a context of {context} tokens leaves no room for a calibration prompt and "
                         f"{new_tokens} new tokens; raise the context or lower the new tokens.")
    out = {}
    for task, text in prompts.items():
        ids = list(tokenizer.encode(text).ids)
        full = len(ids)
        if limit is not None and full > limit:
            ids = ids[-limit:]
        if not ids:
            raise UsageError(f"the '{task}' calibration prompt encodes to no tokens.")
        out[task] = EncodedPrompt(task, ids, full)
    return out
