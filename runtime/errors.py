"""The project's one error hierarchy and the one map from errors to exit codes (docs/commands.md, "Exit codes").

Every error a user can cause or meet is a `StrataError` whose class carries its exit code: 2 for bad usage or bad
input (`UsageError`), 1 for work that failed (`WorkError`). Its message is one sentence saying what is wrong and
what to do. The command-line front ends (`strata-setup`, `strata-run`, `strata-serve`) all call `exit_code` and
`message` here, so a class decides its code once, for every command.

Bad-input classes also derive from `ValueError`, and failures of I/O from `OSError`, so callers that catch the
builtin kinds keep working.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_WORK = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class StrataError(Exception):
    """Base of every error the commands report as one sentence."""

    exit_code = EXIT_WORK


class UsageError(StrataError, ValueError):
    """Bad usage or bad input (a flag, a config, a model folder, a file): exit code 2."""

    exit_code = EXIT_USAGE


class WorkError(StrataError):
    """The work failed (network, checksum, conversion, out of memory, a runtime check): exit code 1."""

    exit_code = EXIT_WORK


class ConfigError(UsageError):
    """A config that cannot be used: a strata-setup TOML config or a model's config.json."""


class LoadError(UsageError):
    """A model folder or file that cannot be loaded (missing, misshaped or unexpected tensor, bad JSON)."""


class ContractError(UsageError):
    """A DFlash2 checkpoint or converted file that breaks the checkpoint contract (docs/formats.md)."""


class QuantFormatError(UsageError):
    """A tensor that cannot be stored in the requested block format (docs/formats.md, "Block formats")."""


class StaleArtifactError(UsageError):
    """A file a config names is gone since setup verified it (the config names nothing there now)."""


class CorruptArtifactError(WorkError):
    """A file a config names changed since setup verified it (size or sha256), or `models verify` marked its store
    item failed: a checksum failure, repaired by pulling or setting up again."""


def one_of(choices) -> str:
    """"a, b or c": how messages list the allowed values."""
    items = [str(c) for c in choices]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "OutOfMemory" in type(exc).__name__


def exit_code(exc: BaseException) -> int | None:
    """The exit code for `exc`, or None for an unexpected error (a bug: the front end says so)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, StrataError):
        return exc.exit_code
    if _is_out_of_memory(exc) or isinstance(exc, OSError):
        return EXIT_WORK
    return None


def message(exc: BaseException) -> str:
    """One sentence for the user."""
    if isinstance(exc, StrataError):
        return str(exc)
    if _is_out_of_memory(exc):
        where = "GPU " if "OutOfMemory" in type(exc).__name__ else ""
        return f"out of {where}memory; lower the context or the expert cache slots in the config."
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc)
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{what}{where}; check the path, its permissions and free space, then retry."
    return f"unexpected error: {type(exc).__name__}: {exc} (rerun with --debug for details)."
