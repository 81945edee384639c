"""Where outputs go: a directory the user names (``--out``, ``--plots``) must be one,
or be creatable, before any work starts.

Without this check a ``--out`` naming an existing file ends, after the work is done,
in ``FileExistsError`` from ``mkdir``; one under a file in ``NotADirectoryError``.
"""

from __future__ import annotations

import os
from pathlib import Path

from data.errors import UserError
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
