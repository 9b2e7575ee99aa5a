"""A GGUF model published as split parts (llama.cpp's `gguf-split`, gguf-py's sharded writer): one model read
from several files (docs/formats.md, "Split GGUF files").

A split series is named `PREFIX-00001-of-0000N.gguf` ... `PREFIX-0000N-of-0000N.gguf`. Every part is a GGUF file
with its own header and tensor table; each carries `split.no` (0-based) and `split.count`, and the first also
`split.tensors.count` (the tensors of all parts) and all of the model's metadata. A target is named by its first
part; the others must lie beside it. `GGUFSet` reads the parts as one file: the first part's metadata, every
part's tensors by name, each tensor's data from the part that holds it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from runtime.errors import LoadError
from runtime.formats.gguf_meta import metadata, open_gguf

PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS = "split.tensors.count"


def part_of(name: str) -> tuple[str, int, int] | None:
    """(prefix, part number from 1, part count) of a split part's file name; None for any other name."""
    m = PART_NAME.match(name)
    if m is None:
        return None
    no, count = int(m.group("no")), int(m.group("count"))
    return (m.group("prefix"), no, count) if 1 <= no <= count and count > 1 else None


def part_names(name: str) -> list[str]:
    """Every file name of the split series `name` belongs to, first to last ([name] for a single file)."""
    p = part_of(name)
    if p is None:
        return [name]
    prefix, _, count = p
    suffix = name[-len(".gguf"):]
    return [f"{prefix}-{i:05d}-of-{count:05d}{suffix}" for i in range(1, count + 1)]


class GGUFSet:
    """The parts of one GGUF model as one file: `meta` (the first part's metadata), `tensors` (name -> gguf-py
    tensor, from every part), `paths` (the parts, first to last), `path` (the first)."""

    def __init__(self, path: str | Path, *, error: type[Exception] = LoadError) -> None:
        path = Path(path)
        names = part_names(path.name)
        if names[0] != path.name:
            raise error(f"{path} is part {part_of(path.name)[1]} of a split GGUF file; give its first part, "
                        f"{names[0]}.")
        self.paths = [path.parent / n for n in names]
        self.path = path
        self.readers = []
        for i, p in enumerate(self.paths):
            if not p.is_file():
                raise error(f"{path.name} is the first of {len(names)} parts of a split GGUF file and part {i + 1}, "
                            f"{p.name}, is missing beside it; download every part.")
            self.readers.append(open_gguf(p, error=error))
        self.meta = metadata(self.readers[0])
        self.tensors: dict[str, Any] = {}
        self.owner: dict[str, int] = {}
        for i, (p, r) in enumerate(zip(self.paths, self.readers, strict=True)):
            if len(names) > 1:
                m = metadata(r, "split.")
                if m.get(KEY_SPLIT_NO) != i or m.get(KEY_SPLIT_COUNT) != len(names):
                    raise error(f"{p.name} says it is part {m.get(KEY_SPLIT_NO)} (from 0) of {m.get(KEY_SPLIT_COUNT)}, "
                                f"not part {i} of {len(names)} as its name does; the parts do not belong together.")
            for t in r.tensors:
                if t.name in self.tensors:
                    raise error(f"{p.name} holds tensor {t.name} again (part {self.owner[t.name] + 1} has it); the "
                                f"parts do not belong together.")
                self.tensors[t.name] = t
                self.owner[t.name] = i
        want = self.meta.get(KEY_SPLIT_TENSORS)
        if len(names) > 1 and want != len(self.tensors):
            raise error(f"the {len(names)} parts of {path.name} hold {len(self.tensors)} tensors, and its first part "
                        f"says {want}; a part is damaged or from another upload.")
        for k in (KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS):
            self.meta.pop(k, None)
