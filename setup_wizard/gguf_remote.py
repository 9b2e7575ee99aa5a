"""The header of a GGUF file on the Hub, read with ranged requests (docs/commands.md, "A GGUF file from the Hub"):
its metadata (architecture, tokenizer) and tensor table, so `models add` can check a multi-gigabyte file as the
runtime will load it, and budget it, before any weight moves.

The bytes fetched are written at their place in a sparse file of the file's full size, so gguf-py's own reader
parses them (the weights region reads as zeros and is never looked at). The header's length is not known up front:
a first read, then longer ones until the reader's parse ends (its data offset) inside the bytes fetched; every
byte the parse used was then fetched, so the result is exact. These bytes are not hashed (only the whole file can
be checked against its pin); the pull hashes the file while it streams, and setup checks the downloaded file's
tensor table again.
"""

from __future__ import annotations

import struct
from pathlib import Path

from runtime.errors import UsageError, WorkError

FIRST_READ = 8 << 20          # a Qwen3 file's header (its 151k-token vocabulary and merges) is about 6 MiB
HEADER_LIMIT = 256 << 20      # a longer header is not one Strata reads
_COUNT_LIMIT = 1 << 20        # tensors or metadata keys: more is a damaged or hostile file, not a model


def _ranged(url: str, start: int, n: int, headers: dict[str, str]) -> bytes:
    """Bytes [start, start + n) of `url`; a server that ignores the range answers the whole file, of which only
    what is needed is read before the connection is closed."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    want = {**headers, "Range": f"bytes={start}-{start + n - 1}"}
    with get_session().stream("GET", url, headers=want, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        skip = start if r.status_code == 200 else 0
        out = bytearray()
        for chunk in r.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            out += chunk
            if len(out) >= n:
                break
    if len(out) < n:
        raise WorkError(f"The Hub sent {len(out)} of the {n} header bytes asked for at {url}; retry.")
    return bytes(out[:n])


def _check_counts(head: bytes, what: str) -> None:
    if len(head) < 24 or head[:4] != b"GGUF":
        raise UsageError(f"{what} is not a GGUF file (it does not start with the GGUF magic).")
    version, tensors, keys = struct.unpack_from("<IQQ", head, 4)
    if version not in (2, 3):
        raise UsageError(f"{what} is GGUF version {version}; Strata reads versions 2 and 3.")
    if tensors > _COUNT_LIMIT or keys > _COUNT_LIMIT:
        raise UsageError(f"{what} declares {tensors} tensors and {keys} metadata keys; it is not a model file.")


def read_header(url: str, size: int, dest: Path, *, headers: dict[str, str], what: str) -> Path:
    """A sparse copy of the GGUF file at `url` (`size` bytes) at `dest` that holds its header: every byte the
    metadata and tensor table take, fetched with ranged requests. UsageError when it is not a GGUF file Strata
    can parse; network errors are raised as huggingface_hub raises them."""
    import gguf

    if size < 24:
        raise UsageError(f"{what} has {size} bytes, fewer than a GGUF header's first fields; it is not a GGUF file.")
    dest = Path(dest)
    have = b""
    want = min(FIRST_READ, size)
    problem = "it is shorter than its header"
    while True:
        have += _ranged(url, len(have), want - len(have), headers)
        _check_counts(have, what)
        with open(dest, "wb") as fh:
            fh.write(have)
            fh.truncate(size)
        try:
            reader = gguf.GGUFReader(str(dest), "r")
            end = int(reader.data_offset)
            del reader
            if end <= len(have):
                return dest
            problem = f"its header ends at byte {end:,}"
        except Exception as exc:   # the parse ran into bytes not fetched yet (zeros), or the file is damaged
            problem = f"{type(exc).__name__}: {exc}"
        if want >= size or want >= HEADER_LIMIT:
            break
        want = min(want * 4, size, HEADER_LIMIT)
    if want >= HEADER_LIMIT and size > HEADER_LIMIT:
        raise UsageError(f"{what} has no GGUF header within its first {HEADER_LIMIT >> 20} MiB ({problem}); it is "
                         f"not a model file Strata reads.")
    raise UsageError(f"{what} is not a readable GGUF file ({problem}).")
