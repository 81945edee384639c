"""Where outputs go: a directory the user names (``--out``, ``--plots``) must be one,
or be creatable, before any work starts.

Without this check a ``--out`` naming an existing file ends, after the work is done,
in ``FileExistsError`` from ``mkdir``; one under a file in ``NotADirectoryError``.
"""

from __future__ import annotations

import os
from pathlib import Path

from data.errors import DataError, UserError
from data.remote import is_uri


def local_path(path: str | os.PathLike[str], flag: str) -> None:
    """A :class:`UserError` naming ``flag`` if ``path`` is a URI: only data files are read
    from object storage (data/remote.py); ``Path("s3://b/run")`` would be a local ``s3:/b/run``."""
    if is_uri(str(path)):
        raise UserError(f"{flag} {path}: run directories and outputs (checkpoints, preprocessing, "
                        "scores, plots) are on a local or shared file system; only data may be a URI")


def output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` when it is a directory, or can be made one, and can be written in;
    else a :class:`UserError` naming ``flag`` (``--out``) and the path."""
    local_path(path, flag)
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p}: is a file, not a directory; name a directory (new or existing)")
    ancestor = p
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{flag} {p}: {ancestor} is a file, so no directory can be made below it")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {p}: {ancestor} is not writable by this user")
    return p


def not_the_data(out: str | os.PathLike[str], data: str, flag: str) -> None:
    """A :class:`UserError` naming ``flag`` where the file ``out`` is one of ``data``'s
    files (writing it would destroy them: ``dlrm predict --out`` and ``eval --scores``
    did so without a word until 2026-12-07), or a Parquet file inside one of ``data``'s
    directories, which every later read of them would take in as data."""
    from data.files import expand_paths

    target = os.path.realpath(out)
    try:
        files = expand_paths(data)
    except DataError:  # the read itself says what is wrong with ``data``
        return
    if any(not is_uri(f) and os.path.realpath(f) == target for f in files):
        raise UserError(f"{flag} {out}: is one of the --data files, which writing it would "
                        "destroy; name another file")
    items = [data] if Path(data).expanduser().exists() else [p.strip() for p in data.split(",")]
    for item in items:
        root = Path(item).expanduser()
        if is_uri(item) or not root.is_dir() or not target.endswith(".parquet"):
            continue
        inside = Path(target).is_relative_to(os.path.realpath(root))
        below = Path(target).relative_to(os.path.realpath(root)).parts if inside else ()
        if below and not any(part.startswith((".", "_")) for part in below):
            raise UserError(f"{flag} {out}: is inside the --data directory {item}, whose every "
                            "later read would take it in as data; write it elsewhere")
