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
symlink, ``..``, a directory and a glob) is read once. A URI (``s3://bucket/train/``,
``gs://…``, ``hdfs://…``, ``file://…``) is listed and opened through pyarrow's file
systems under the same rules (:mod:`data.remote`). Every file is written
under such a temporary name and renamed when complete (:mod:`data.atomic`), so a
reader never sees half a file.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from data.atomic import AtomicPath
from data.errors import DataError, one_line
from data.names import PRIVATE, glob_takes, natural_key
from data.remote import expand_uri, is_uri, normalized, other_files, resolve

if TYPE_CHECKING:
    from typing import BinaryIO

    import pyarrow as pa
    import pyarrow.parquet as pq

_GLOB_CHARS = re.compile(r"[*?\[]")
_PART = re.compile(r"^part-(\d{5,})\.parquet$")


def expand_paths(spec: str | list[str]) -> list[str]:
    """Files named by ``spec``: files, directories, globs, comma-separated lists.

    Directories contribute every ``*.parquet`` below them (recursively, sorted,
    skipping names that start with '.' or '_'); globs contribute their matches
    in name order, less those with a part starting with '_' or '.' below the pattern's
    fixed directories unless the pattern's own part there does. A string is split at
    commas unless it names an existing path whole; a list's entries are not split. Duplicates (the same file however reached: its real path) are dropped, first
    occurrence kept. A part that matches nothing is a :class:`DataError` naming it. A URI
    (``s3://bucket/train/``) is listed through its file system under the same rules
    (:func:`data.remote.expand_uri`); its duplicates are the same URI, normalized.
    """
    if isinstance(spec, str):
        whole = spec.strip()  # a path with a comma in its name, given alone
        items = [whole] if Path(whole).expanduser().exists() else [p.strip() for p in spec.split(",")]
    else:
        items = [p.strip() for p in spec]
    items = [p for p in items if p]
    if not items:
        raise DataError(f"no data files given (spec {spec!r} is empty)")
    found: dict[str, str] = {}  # real path (a URI: as the store names it) → the name first given
    for item in items:
        matches = expand_uri(item) if is_uri(item) else _expand_one(item)
        if not matches:
            raise DataError(f"no Parquet files found for {item!r} (spec {spec!r})"
                            f"{_other_files_hint(item)}")
        for match in matches:
            found.setdefault(normalized(match) if is_uri(match) else os.path.realpath(match), match)
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
    pattern did not ask for (:func:`data.names.glob_takes`): ``out/**/*`` skips
    ``out/_temporary/0/part-0.parquet`` and ``out/_SUCCESS``; ``out/_*`` and
    ``out/_*/x/*`` get what they name, and only that: ``out/_*/*`` skips ``out/_tmp/_SUCCESS``."""
    return not glob_takes(rel, pattern)


def _other_files_hint(item: str) -> str:
    """For a directory with no ``*.parquet`` below it: the files it does hold (Hive and
    Hadoop name Parquet parts ``000000_0``, ``part-00000`` with no suffix), and how to
    name them."""
    if is_uri(item):
        others = other_files(item)
        head, mark, query = item.partition("?")  # the glob goes before a URI's query
        glob_spec = head.rstrip("/") + ("/**/*" if any("/" in o for o in others) else "/*") \
            + mark + query
    else:
        root = Path(item).expanduser()
        if not root.is_dir():
            return ""
        others = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                        and not any(r.startswith(PRIVATE) for r in p.relative_to(root).parts))
        nested = any(os.sep in o for o in others)
        glob_spec = os.path.join(item, "**", "*") if nested else os.path.join(item, "*")
    if not others:
        return ""
    return (f": a directory gives the files named *.parquet below it, and it holds "
            f"{len(others)} other file(s), e.g. {others[0]}; name them with a glob, "
            f"e.g. {glob_spec}")


def _parquet_below(root: Path) -> list[str]:
    """Every ``*.parquet`` below ``root``, sorted, none hidden ('.') or private ('_')."""
    out = []
    for p in root.rglob("*.parquet"):
        rel = p.relative_to(root).parts
        if p.is_file() and not any(r.startswith(PRIVATE) for r in rel):
            out.append(str(p))
    return sorted(out, key=natural_key)


def hive_partitions(files: list[str]) -> dict[str, str]:
    """Each ``key=value`` directory name's key in the files' paths (Hive partitioning, as
    Spark's ``partitionBy`` writes it), in order of first appearance, with one example
    directory: the key's column is in the directory names, not in the files."""
    keys: dict[str, str] = {}
    for path in files:
        for part in Path(urlsplit(path).path if is_uri(path) else path).parent.parts:  # no query
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
        if is_uri(path):  # pre_buffer: a row group's column chunks in one ranged GET, not one each
            fs, inner = resolve(path)
            return pq.ParquetFile(inner, read_dictionary=read_dictionary or None, filesystem=fs,
                                  pre_buffer=True)
        return pq.ParquetFile(path, read_dictionary=read_dictionary or None)
    except FileNotFoundError:
        raise DataError("does not exist", file=path) from None
    except KeyError as e:  # a column of read_dictionary is not there
        raise DataError(f"has no column {one_line(e)}", file=path) from None
    except OSError as e:
        if is_uri(path) and not isinstance(e, pa.ArrowInvalid):  # the store said no
            raise DataError(f"cannot be read ({one_line(e)})", file=path) from None
        raise DataError(f"not a readable Parquet file ({one_line(e)})", file=path) from None
    except pa.ArrowException as e:
        raise DataError(f"not a readable Parquet file ({one_line(e)})", file=path) from None


@dataclass(frozen=True)
class Footer:
    """What a file's footer says: its row groups (``metadata``) and its columns."""

    metadata: pq.FileMetaData
    schema_arrow: pa.Schema


_FOOTERS: OrderedDict[str, Footer] = OrderedDict()  # URI → its footer, most recent last
_FOOTERS_KEPT = 1 << 16
_FOOTERS_LOCK = threading.Lock()


def footer(path: str) -> Footer:
    """``path``'s footer, for code that reads no rows (checks, counts, the schema); errors as
    :func:`open_parquet`'s. A local file's is read each time. A URI's is read once per
    process: a run's start consults each footer about a dozen times (screening, schema,
    header, fit), and on a store each reading costs a HEAD and a GET. A store replaces an
    object whole; one replaced while a run reads it is still caught, as locally, by the
    reader, which opens the file afresh and checks its row groups' rows."""
    if not is_uri(path):
        pf = open_parquet(path)
        return Footer(pf.metadata, pf.schema_arrow)
    with _FOOTERS_LOCK:
        found = _FOOTERS.get(path)
    if found is None:
        pf = open_parquet(path)
        found = Footer(pf.metadata, pf.schema_arrow)
    with _FOOTERS_LOCK:  # a prefetch thread may ask too
        _FOOTERS[path] = found
        _FOOTERS.move_to_end(path)
        if len(_FOOTERS) > _FOOTERS_KEPT:
            _FOOTERS.popitem(last=False)
    return found


class LastOpened:
    """:func:`open_parquet` keeping the last file open: a pass over row groups in file order
    reads each footer once (on an object store a HEAD and a GET each time, 2 of the 3
    requests of a row group read alone), as the reader does."""

    def __init__(self) -> None:
        self._last: tuple[str, pq.ParquetFile] | None = None

    def __call__(self, path: str) -> pq.ParquetFile:
        if self._last is None or self._last[0] != path:
            self._last = None  # a file that fails to open leaves none held
            self._last = (path, open_parquet(path))
        return self._last[1]


def open_input(path: str) -> BinaryIO:
    """``path`` (a local path or a URI) opened for reading bytes, with seek and tell."""
    if is_uri(path):
        fs, inner = resolve(path)
        return fs.open_input_file(inner)
    return open(path, "rb")


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
