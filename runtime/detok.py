"""Incremental detokenization for streaming: each call decodes only the tokens since the last emitted boundary
(plus a short prefix for context), so streaming a long generation costs O(window), not O(output) per window.

The prefix matters: decoders can change the text of a token by what precedes it (leading-space rules, multi-byte
characters split over byte-level tokens), so the new text is the decode of prefix+new minus the decode of prefix.
Text that ends in U+FFFD is an incomplete character: it is held back until the next tokens complete it.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0     # start of the context window decoded with the new tokens
        self.read = 0       # tokens before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def push(self, new: list[int]) -> str:
        """Add tokens; return the text they complete ('' while a character is incomplete)."""
        self.ids.extend(new)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character is emitted as U+FFFD, as decode does)."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if now.startswith(before) else ""
