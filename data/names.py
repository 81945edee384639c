"""How data file names order and which are skipped, for local paths and URIs alike.

    sorted(["day_10", "day_2"], key=natural_key)   ["day_2", "day_10"]
    name.startswith(PRIVATE)                       _SUCCESS, .part-0.parquet.crc: skipped
    glob_takes(("_tmp", "_SUCCESS"), ("_*", "*"))  False: a pattern part answers for its name
"""

from __future__ import annotations

import fnmatch
import re

_DIGITS = re.compile(r"(\d+)")
PRIVATE = (".", "_")  # name prefixes of files a writer leaves beside its data (_SUCCESS, .crc)


def natural_key(path: str) -> tuple[list[str | int], str]:
    """Sort key comparing the runs of digits in ``path`` as numbers: ``day_2`` < ``day_10``.
    ``re.split`` with a group alternates text and digits, so like compares with like.
    Names equal as numbers (``x1``, ``x01``) go by their text: a directory's listing
    order is no order, and every rank must read the files in the same one."""
    return [int(t) if i % 2 else t for i, t in enumerate(_DIGITS.split(path))], path


def glob_takes(rel: tuple[str, ...] | list[str], pattern: tuple[str, ...] | list[str]) -> bool:
    """Whether glob ``pattern`` matches the path parts ``rel`` part by part, each '.'/'_'
    name matched by a pattern part starting so (``**`` takes any number of parts, none of
    them private): ``out/_*`` takes ``out/_tmp``, ``out/_*/*`` skips ``out/_tmp/_SUCCESS``,
    ``out/**/*`` skips ``out/_temporary/0/part-0.parquet``."""
    if not pattern:
        return not rel
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return glob_takes(rel, rest) or (bool(rel) and not rel[0].startswith(PRIVATE)
                                         and glob_takes(rel[1:], pattern))
    return (bool(rel) and fnmatch.fnmatchcase(rel[0], head)
            and (head.startswith(PRIVATE) or not rel[0].startswith(PRIVATE)) and glob_takes(rel[1:], rest))
