"""Giving up a fast path (a kernel that does not build on this GPU, a CUDA graph that does not capture) for a slower
one that computes the same: record why for the benchmarks and say so once, since a user would otherwise see only
a slower run (docs/models.md, "Numerics": the fallback order)."""

from __future__ import annotations

import warnings

# every fast path this process gave up, one line each ("what: error"), in order and without repeats: the engine's
# stats carry them (`strata-run --json`, the server's `strata` block), so a slow run says why
SEEN: list[str] = []


def fell_back(errors: list[str], e: BaseException, what: str, instead: str, prefix: str = "") -> None:
    """Append `prefix` + the error to `errors` and warn: `what` failed here (the error's last line, where a Triton
    compile error names its cause), `instead` runs from now on."""
    errors.append(f"{prefix}{type(e).__name__}: {str(e)[:300]}")
    why = (str(e).strip().splitlines() or [""])[-1][:200]
    line = f"{what}: {type(e).__name__}: {why}"
    if line not in SEEN:
        SEEN.append(line)
    warnings.warn(f"{what} failed here ({type(e).__name__}: {why}); {instead} from now on, which is slower: please "
                  f"report it with your GPU, torch and Triton versions.", RuntimeWarning, stacklevel=3)
