"""Parquet files on disk: finding them from a user's spec, opening them, writing them.

    expand_paths("train/")                 every *.parquet below train/, in name order
    expand_paths("a.parquet,b/*.parquet")  a comma-separated list of files and globs
    expand_paths(["a,b.parquet", "c/"])    a list: each entry one path or glob, commas and all
    write_parts(out_dir, tables, ...)      part-00000.parquet, part-00001.parquet, ...

Name order is natural: numbers in names compare as numbers, so ``day_2`` comes before
``day_10`` and ``part-100000`` after ``part-99999`` (a run over days in order, unshuffled,
reads them in order). Names starting with '.' or '_' are skipped inside directories and
in a glob's matches, at any depth below the glob's fixed directories (Spark's ``_SUCCESS``,
``.part-….crc``, ``_temporary/0/part-…`` of a job still writing, and
``.part-00000.parquet.tmp<pid>`` of our writer at work) unless the glob itself names such
a part (that part alone: ``_*/*`` skips ``_tmp/_SUCCESS``). A file named twice (through a
symlink, ``..``, a directory and a glob) is read once. Every file is written
under such a temporary name and renamed when complete (:mod:`data.atomic`), so a
reader never sees half a file.
"""

from __future__ import annotations

import fnmatch
import glob
import itertools
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from data.atomic import AtomicPath
from data.errors import DataError, one_line

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

_GLOB_CHARS = re.compile(r"[*?\[]")
_PART = re.compile(r"^part-(\d{5,})\.parquet$")
_DIGITS = re.compile(r"(\d+)")
_PRIVATE = (".", "_")


def natural_key(path: str) -> tuple[list[str | int], str]:
    """Sort key comparing the runs of digits in ``path`` as numbers: ``day_2`` < ``day_10``.
    ``re.split`` with a group alternates text and digits, so like compares with like.
    Names equal as numbers (``x1``, ``x01``) go by their text: a directory's listing
    order is no order, and every rank must read the files in the same one."""
    return [int(t) if i % 2 else t for i, t in enumerate(_DIGITS.split(path))], path


def expand_paths(spec: str | list[str]) -> list[str]:
    """Files named by ``spec``: files, directories, globs, comma-separated lists.

    Directories contribute every ``*.parquet`` below them (recursively, sorted,
    skipping names that start with '.' or '_'); globs contribute their matches
    in name order, less those with a part starting with '_' or '.' below the pattern's
    fixed directories unless the pattern's own part there does. A string is split at
    commas unless it names an existing path whole; a list's entries are not split. Duplicates (the same file however reached: its real path) are dropped, first
    occurrence kept. A part that matches nothing is a :class:`DataError` naming it.
    """
    if isinstance(spec, str):
        whole = spec.strip()  # a path with a comma in its name, given alone
        items = [whole] if Path(whole).expanduser().exists() else [p.strip() for p in spec.split(",")]
    else:
        items = [p.strip() for p in spec]
    items = [p for p in items if p]
    if not items:
        raise DataError(f"no data files given (spec {spec!r} is empty)")
    found: dict[str, str] = {}  # real path → the name first given
    for item in items:
        matches = _expand_one(item)
        if not matches:
            raise DataError(f"no Parquet files found for {item!r} (spec {spec!r})"
                            f"{_other_files_hint(item)}")
        for match in matches:
            found.setdefault(os.path.realpath(match), match)
    return list(found.values())


def _expand_one(item: str) -> list[str]:
    path = Path(item).expanduser()
    if path.is_dir():
        return _parquet_below(path)
    if path.is_file():
        return [str(path)]
    if not _GLOB_CHARS.search(item):
        return []
    root, pattern = _glob_root(path)
    out: list[str] = []
    for match in sorted(glob.glob(str(path), recursive=True), key=natural_key):
        if _private_match(Path(match).relative_to(root).parts, pattern):
            continue
        out.extend(_parquet_below(Path(match)) if os.path.isdir(match) else [match])
    return out


def _glob_root(path: Path) -> tuple[Path, tuple[str, ...]]:
    """``path`` split into its fixed directories and the parts from the first glob on."""
    parts = path.parts
    first = next(i for i, p in enumerate(parts) if _GLOB_CHARS.search(p))
    return Path(*parts[:first]) if first else Path(), parts[first:]


def _private_match(rel: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether a match's parts below the fixed directories hold a '.' or '_' name the
    pattern did not ask for: ``out/**/*`` skips ``out/_temporary/0/part-0.parquet`` and
    ``out/_SUCCESS``; ``out/_*`` and ``out/_*/x/*`` get what they name, and only that:
    ``out/_*/*`` skips ``out/_tmp/_SUCCESS`` (a pattern part answers for the name it
    matches, not for every part of the match)."""
    return not _asked_for(rel, pattern)


def _asked_for(rel: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether ``pattern`` matches ``rel`` part by part with each '.'/'_' name matched by a
    pattern part starting so (``**`` takes any number of parts, none of them private)."""
    if not pattern:
        return not rel
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return _asked_for(rel, rest) or (bool(rel) and not rel[0].startswith(_PRIVATE)
                                          and _asked_for(rel[1:], pattern))
    return (bool(rel) and fnmatch.fnmatchcase(rel[0], head)
            and (head.startswith(_PRIVATE) or not rel[0].startswith(_PRIVATE)) and _asked_for(rel[1:], rest))


def _other_files_hint(item: str) -> str:
    """For a directory with no ``*.parquet`` below it: the files it does hold (Hive and
    Hadoop name Parquet parts ``000000_0``, ``part-00000`` with no suffix), and how to
    name them."""
    root = Path(item).expanduser()
    if not root.is_dir():
        return ""
    others = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                    and not any(r.startswith(_PRIVATE) for r in p.relative_to(root).parts))
    if not others:
        return ""
    nested = any(os.sep in o for o in others)
    glob_spec = os.path.join(item, "**", "*") if nested else os.path.join(item, "*")
    return (f": a directory gives the files named *.parquet below it, and it holds "
            f"{len(others)} other file(s), e.g. {others[0]}; name them with a glob, "
            f"e.g. {glob_spec}")


def _parquet_below(root: Path) -> list[str]:
    """Every ``*.parquet`` below ``root``, sorted, none hidden ('.') or private ('_')."""
    out = []
    for p in root.rglob("*.parquet"):
        rel = p.relative_to(root).parts
        if p.is_file() and not any(r.startswith(_PRIVATE) for r in rel):
            out.append(str(p))
    return sorted(out, key=natural_key)


def hive_partitions(files: list[str]) -> dict[str, str]:
    """Each ``key=value`` directory name's key in the files' paths (Hive partitioning, as
    Spark's ``partitionBy`` writes it), in order of first appearance, with one example
    directory: the key's column is in the directory names, not in the files."""
    keys: dict[str, str] = {}
    for path in files:
        for part in Path(path).parent.parts:
            key, eq, _ = part.partition("=")
            if eq and key:
                keys.setdefault(key, part)
    return keys


def open_parquet(path: str, read_dictionary: list[str] | None = None) -> pq.ParquetFile:
    """Open ``path``'s footer; a missing, truncated or non-Parquet file is a DataError.
    ``read_dictionary``: string and binary columns to read dictionary-encoded, as the
    file stores them (other types named there are read as they are)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, read_dictionary=read_dictionary or None)
    except FileNotFoundError:
        raise DataError("does not exist", file=path) from None
    except KeyError as e:  # a column of read_dictionary is not there
        raise DataError(f"has no column {one_line(e)}", file=path) from None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"not a readable Parquet file ({one_line(e)})", file=path) from None


def write_parts(
    out_dir: str,
    tables: Iterable[pa.Table],
    schema: pa.Schema,
    file_rows: int,
    row_group_rows: int,
    first: int = 0,
    prune: bool = True,
) -> list[str]:
    """Write a stream of tables as ``out_dir/part-NNNNN.parquet`` (numbered from
    ``first``); return the paths.

    The stream is re-cut into row groups of ``row_group_rows`` rows and files of
    ``file_rows`` rows (the last of each may be short; a row group never spans
    two files). Memory holds one row group. Each file is written as
    ``.part-NNNNN.parquet.tmp<pid>`` and renamed when complete; if the stream fails,
    the files of this run are removed again. Stale ``part-NNNNN.parquet`` files
    of an earlier, longer run are removed so the directory holds exactly this
    dataset (``prune``; a writer of one part among others leaves that to its caller:
    :func:`remove_stale_parts`).
    """
    import pyarrow as pa

    if file_rows < 1 or row_group_rows < 1:
        raise ValueError(f"file_rows {file_rows} and row_group_rows {row_group_rows} must be >= 1")
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    pending: list[pa.Table] = []
    pending_rows = 0
    writer: _PartWriter | None = None
    try:
        for table in itertools.chain(tables, [None]):
            if table is not None and table.num_rows:
                pending.append(table.cast(schema))
                pending_rows += table.num_rows
            while pending_rows and (table is None or pending_rows >= row_group_rows):
                if writer is None:
                    writer = _PartWriter(out_dir, first + len(written), schema)
                n = min(row_group_rows, file_rows - writer.rows, pending_rows)
                block = pa.concat_tables(pending)
                writer.write(block.slice(0, n).combine_chunks())
                rest = block.slice(n)
                pending, pending_rows = ([rest] if rest.num_rows else []), pending_rows - n
                if writer.rows == file_rows:
                    written.append(writer.close())
                    writer = None
        if writer is not None:
            written.append(writer.close())
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        for path in written:  # a failed run leaves no dataset that looks complete
            os.remove(path)
        raise
    if prune:
        remove_stale_parts(out_dir, first + len(written))
    return written


class _PartWriter:
    """One output file: written under a temporary name, renamed by ``close``."""

    def __init__(self, out_dir: str, index: int, schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        self.path = os.path.join(out_dir, f"part-{index:05d}.parquet")
        self._file = AtomicPath(self.path)
        self.rows = 0
        self._writer = pq.ParquetWriter(str(self._file.tmp), schema)

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table, row_group_size=table.num_rows)
        self.rows += table.num_rows

    def close(self) -> str:
        self._writer.close()
        self._file.commit()
        return self.path

    def abort(self) -> None:
        self._writer.close()
        self._file.abort()


def remove_stale_parts(out_dir: str, keep: int) -> None:
    """Remove ``part-NNNNN.parquet`` files numbered ``keep`` and up."""
    for name in os.listdir(out_dir):
        m = _PART.match(name)
        if m and int(m.group(1)) >= keep:
            os.remove(os.path.join(out_dir, name))
