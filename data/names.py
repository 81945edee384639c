"""How data file names order and which are skipped, for local paths and URIs alike.

    sorted(["day_10", "day_2"], key=natural_key)   ["day_2", "day_10"]
    name.startswith(PRIVATE)                       _SUCCESS, .part-0.parquet.crc: skipped
"""

from __future__ import annotations

import re

_DIGITS = re.compile(r"(\d+)")
PRIVATE = (".", "_")  # name prefixes of files a writer leaves beside its data (_SUCCESS, .crc)


def natural_key(path: str) -> list[str | int]:
    """Sort key comparing the runs of digits in ``path`` as numbers: ``day_2`` < ``day_10``.
    ``re.split`` with a group alternates text and digits, so like compares with like."""
    return [int(t) if i % 2 else t for i, t in enumerate(_DIGITS.split(path))]
