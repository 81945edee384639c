"""Where outputs go: a directory the user names (``--out``, ``--plots``) must be one,
or be creatable, before any work starts.

Without this check a ``--out`` naming an existing file ends, after the work is done,
in ``FileExistsError`` from ``mkdir``; one under a file in ``NotADirectoryError``.
"""

from __future__ import annotations

import os
from pathlib import Path

from data.errors import UserError


def output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` when it is a directory, or can be made one, and can be written in;
    else a :class:`UserError` naming ``flag`` (``--out``) and the path."""
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
