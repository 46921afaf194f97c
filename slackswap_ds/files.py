"""Files read and written whole, for plan files and traces. Read: JSON whatever the file holds, or
an InvalidFileError that names the file (never a RecursionError from a file nested 100k deep, or a
ValueError from a 100k-digit number). Written: atomically (a temporary file in the same
folder, then `os.replace`: a reader sees the old file or the new one, never half of one), never
through a link (a link at the path is itself replaced: a job run as root that writes into a shared
folder cannot be made to overwrite the file a planted link points at), and never over what is not a
regular file (a device such as /dev/full, a FIFO). Torch-free."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from .errors import InvalidFileError


# what json.loads of a file's text raises besides JSONDecodeError: ValueError for text that is not
# UTF-8 or a 100k-digit number, RecursionError for arrays nested 100k deep
JSON_ERRORS = (ValueError, RecursionError)


def json_problem(e: BaseException) -> str:
    """Why a JSON text could not be read, in words (for an error that names the file)."""
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def read_json(path: str | Path, what: str, fix: str = "") -> object:
    """The JSON in `path`; InvalidFileError "cannot read {what} {path}: {why}{fix}" if it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, *JSON_ERRORS) as e:
        raise InvalidFileError(f"cannot read {what} {str(path)!r}: {json_problem(e)}{fix}") from None


def refuse_unless_regular(path: str | Path) -> None:
    """OSError if `path` exists as something a write must not replace: neither a regular file nor a
    link (a link is replaced, not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise OSError(f"{str(path)!r} exists and is not a regular file")


def write_atomically(path: str | Path, text: str) -> None:
    """`text` to `path` as one new file in the same folder; OSError (nothing changed) if it cannot."""
    path = Path(path)
    refuse_unless_regular(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["JSON_ERRORS", "json_problem", "read_json", "refuse_unless_regular", "write_atomically"]
