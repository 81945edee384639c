"""Atomic file writes: a reader sees the old file or the whole new one, never half.

    write_atomic(path, text_or_bytes)       small files written in one go
    with atomic_path(path) as tmp:          writers that want a path of their own
        fig.savefig(tmp)                    (matplotlib, torch.save, export_chrome_trace)
    AtomicPath(path) ... .commit()/.abort() the same, for a writer that outlives a block
                                            (a ParquetWriter kept open across calls)

Each writes ``.NAME.tmpPID`` beside ``path`` (same directory, so the rename stays on one
file system; hidden, so directory listings that skip '.' names never pick it up; the
pid keeps two processes from sharing one), fsyncs it, renames it over ``path`` and
fsyncs the directory, so after a crash the name holds one complete version. A failure
before the rename removes the temporary file and leaves ``path`` as it was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class AtomicPath:
    """A temporary path beside ``path``; :meth:`commit` puts what was written there at ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")

    def commit(self) -> Path:
        """fsync the temporary file, rename it over ``path``, fsync the directory; ``path``."""
        fsync(self.tmp)
        os.replace(self.tmp, self.path)
        fsync(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Remove the temporary file, if any; ``path`` is left as it was."""
        self.tmp.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write; on leaving the block it becomes ``path`` (or, on
    an exception, is removed)."""
    target = AtomicPath(path)
    try:
        yield target.tmp
    except OSError as e:
        target.abort()
        if e.filename not in (None, str(target.tmp)):
            raise
        raise OSError(e.errno, e.strerror, str(target.path)) from None  # the file meant
    except BaseException:
        target.abort()
        raise
    target.commit()


def write_atomic(path: str | os.PathLike[str], content: str | bytes) -> None:
    """Write ``content`` (text as UTF-8) to ``path`` atomically."""
    data = content.encode() if isinstance(content, str) else content
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush a file or directory to disk (a directory: the names in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def existing_part(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it exists, else its nearest existing parent: where a file
    system is asked about a path not made yet."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes of the file system ``path`` is (or will be) on."""
    try:
        return shutil.disk_usage(existing_part(path)).free
    except OSError:
        return None
