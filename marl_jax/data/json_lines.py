"""Local JSON Lines files checked line by line before `datasets` reads them.

A malformed line (not JSON, or JSON that is not an object) would fail the whole load inside
`datasets`; here it is left out and reported with the load's skipped rows, by file and line
number. A file without bad lines is read as it is. A file with bad lines is read from a copy of
its good lines, written once under the `datasets` cache and named by the file's path, size and
modification time, so later loads find both the copy and its Arrow cache.

Like the `datasets` json builder, a `.json` file is JSON Lines unless it starts with "[" (one JSON
array of rows, read by `datasets` as it is). Blank lines are ignored.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Optional, Sequence

CLEAN_DIR = "marl_jax_json_lines"
LINES_SHOWN = 5
_BOM = b"\xef\xbb\xbf"


@dataclasses.dataclass(frozen=True)
class BadLines:
    """The malformed lines of one file.

    Attributes:
      name: the file as reported (relative to the dataset path).
      lines: 1-based line numbers.
      rows_before: for each line, the good rows of the split (over all its files, in order)
        before it; the line was reached by a load of the first `max_rows` rows when this is
        below `max_rows`.
    """

    name: str
    lines: tuple[int, ...]
    rows_before: tuple[int, ...]

    def reached(self, max_rows: Optional[int]) -> tuple[int, ...]:
        """The line numbers a load of the first `max_rows` rows (None = all) reads."""
        return tuple(line for line, before in zip(self.lines, self.rows_before)
                     if max_rows is None or before < max_rows)


def reason(name: str, lines: Sequence[int]) -> str:
    """The skip reason of bad `lines` of file `name`, naming the first few."""
    shown = ", ".join(str(line) for line in lines[:LINES_SHOWN])
    more = f", ... ({len(lines) - LINES_SHOWN} more)" if len(lines) > LINES_SHOWN else ""
    return f"malformed JSON lines of {name} (line{'s' if len(lines) > 1 else ''} {shown}{more})"


def check_files(files: Sequence[pathlib.Path], names: Sequence[str], clean_root):
    """(the files `datasets` should read, a `BadLines` per file that has any).

    Args:
      files: the split's data files, in reading order.
      names: how each file is reported.
      clean_root: the `datasets` cache directory, which holds the copies of good lines.
    """
    readable, bad, good_rows = [], [], 0
    for file, name in zip(files, names):
        if not _is_json_lines(file):
            good_rows += _array_rows(file)
            readable.append(file)
            continue
        lines, rows_before, good = [], [], 0
        for number, line in _lines(file):
            if _is_row(line):
                good += 1
            else:
                lines.append(number)
                rows_before.append(good_rows + good)
        if lines and not good:
            raise ValueError(f"no line of {file} is a JSON object; is it a JSON Lines file?")
        good_rows += good
        if lines:
            bad.append(BadLines(name, tuple(lines), tuple(rows_before)))
            readable.append(_good_lines_copy(file, pathlib.Path(clean_root)))
        else:
            readable.append(file)
    return readable, bad


def _open(file):
    return gzip.open(file, "rb") if file.name.lower().endswith(".gz") else open(file, "rb")


def _is_json_lines(file) -> bool:
    with _open(file) as f:
        start = f.read(64).removeprefix(_BOM).lstrip()
    return not start.startswith(b"[")


def _array_rows(file) -> int:
    """The rows of a JSON array file; 0 when it does not parse (`datasets` then says why)."""
    with _open(file) as f:
        try:
            rows = json.loads(f.read().removeprefix(_BOM))
        except ValueError:
            return 0
    return len(rows) if isinstance(rows, list) else 0


def _lines(file):
    """(1-based number, bytes) of the non-blank lines, without a leading byte-order mark."""
    with _open(file) as f:
        for number, line in enumerate(f, start=1):
            if number == 1:
                line = line.removeprefix(_BOM)
            if line.strip():
                yield number, line


def _is_row(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # not JSON, or not UTF-8
        return False


def _good_lines_copy(file, clean_root: pathlib.Path) -> pathlib.Path:
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    # A hex name never looks like a split file, should the cache sit inside the data directory.
    copy = clean_root / CLEAN_DIR / f"{key.hexdigest()[:32]}.jsonl"
    if copy.exists():
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its final name and renamed: processes loading at once each see a whole file.
    fd, tmp = tempfile.mkstemp(prefix=f".{copy.name}.", dir=copy.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for _, line in _lines(file):
                if _is_row(line):
                    out.write(line if line.endswith(b"\n") else line + b"\n")
        os.replace(tmp, copy)
    except BaseException:
        os.unlink(tmp)
        raise
    return copy
