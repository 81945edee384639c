"""Byte counts as people write them ("16GB", "512MiB") and as we print them ("3.2 GiB")."""

from __future__ import annotations

import re

from embeddings.plan.types import PlanError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """Bytes in ``text``: "16GB", "16 GiB", "512MiB", "1.5G", "4096"; "" → None (no limit).

    Without an "i" the units are powers of 1000 (16GB = 16e9 bytes), with one
    powers of 1024 (16GiB = 16 * 2^30), as Kubernetes reads them. A budget given as
    "16GB" is then the smaller reading, the safe side for a memory limit.
    """
    if not text.strip():
        return None
    m = _SIZE.match(text)
    if m is None or (m[3] and not m[2]):
        raise PlanError(f"size {text!r}: expected a number and a unit, like 16GB, 512MiB or 1.5G")
    power = "kmgtp".index(m[2].lower()) + 1 if m[2] else 0
    size = round(float(m[1]) * (1024 if m[3] else 1000) ** power)
    if size <= 0:
        raise PlanError(f"size {text!r} must be more than 0 bytes")
    return size


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: "512 B", "1.5 KiB", "3.2 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
