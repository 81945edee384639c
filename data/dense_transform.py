"""Dense transforms and the statistics they need, gathered in the preprocessing pass.

    none         x
    log1p        log(1 + max(x, 0))      (what dlrm convert-criteo writes; counts → 0..~20)
    standardize  (x - mean) / std        (std 0 → 1: a constant column becomes 0)

Raw counts (clicks, impressions, seconds) reach the bottom MLP as values up to 1e6 and
more beside values of 0..10, and one large value saturates a whole batch: on a
Criteo-like set the same model reached a clearly lower AUC untransformed than after
log1p (issue 13 has the figures). :meth:`DenseStats.looks_like_counts` spots such a column (non-negative,
max above 100 and at least 100x its median) so the run can say which setting helps.

The median is read from a histogram of quarter-octave bins of log2(1 + |x|)
(mergeable and deterministic, within a factor of 2^(1/4)): enough to tell 5 from 5e6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

TRANSFORMS = ("none", "log1p", "standardize")
_BINS = 4 * 64 + 1  # quarter-octaves of log2(1 + |x|) up to 2^64; the last catches the rest
_CHUNK = 1 << 14  # values taken in at a time (see DenseStats.add)


@dataclass
class DenseStats:
    """Running count, sum, sum of squares, min, max and a log histogram of one column."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")
    negative: int = 0
    bins: np.ndarray = field(default_factory=lambda: np.zeros(_BINS, np.int64))

    def add(self, x: np.ndarray) -> None:
        """Take in finite values ``x`` [n] (one row group's float32 values before a
        transform): ``absorb(DenseStats.of(x))``, so that the float sums are the same
        whether one process reads every row group or a split gathers them (see
        data/fit_split.py)."""
        self.absorb(DenseStats.of(x))

    @staticmethod
    def of(x: np.ndarray) -> DenseStats:
        """The statistics of ``x`` alone, :data:`_CHUNK` values at a time: a row group's
        float64 temporaries at once would each be fresh pages (3x slower)."""
        out = DenseStats()
        for start in range(0, x.size, _CHUNK):
            out._add(x[start:start + _CHUNK])
        return out

    def absorb(self, other: DenseStats, sums: bool = True) -> None:
        """Add ``other``'s counts, extremes and histogram; its float sums too unless
        ``sums`` is False (a split adds those in row-group order itself)."""
        self.count += other.count
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)
        self.negative += other.negative
        self.bins += other.bins
        if sums:
            self.total += other.total
            self.squares += other.squares

    def _add(self, x: np.ndarray) -> None:
        x = x.astype(np.float64)
        if not np.isfinite(x.sum()):
            x = x[np.isfinite(x)]
        if x.size == 0:
            return
        self.count += int(x.size)
        self.total += float(x.sum())
        self.squares += float(np.square(x).sum())  # not np.dot: BLAS threads vary the sum
        self.low, self.high = min(self.low, float(x.min())), max(self.high, float(x.max()))
        self.negative += int(np.count_nonzero(x < 0))
        self.bins += np.bincount(_bin(x), minlength=_BINS)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        if not self.count:
            return 0.0
        return float(np.sqrt(max(self.squares / self.count - self.mean**2, 0.0)))

    def median(self) -> float:
        """About the median of |x| (the lower edge of the bin holding it)."""
        if not self.count:
            return 0.0
        k = int(np.searchsorted(np.cumsum(self.bins), (self.count + 1) // 2))
        return float(2.0 ** (k / 4) - 1)

    def looks_like_counts(self) -> bool:
        """Non-negative, max above 100 and at least 100x the median (at least 1)."""
        return (self.count > 0 and self.negative == 0 and self.high > 100
                and self.high >= 100 * max(self.median(), 1.0))

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "std": self.std,
                "min": self.low if self.count else None, "max": self.high if self.count else None,
                "median": self.median(), "negative": self.negative,
                "total": self.total, "squares": self.squares, "bins": self.bins.tolist()}

    @staticmethod
    def from_json(d: dict[str, Any]) -> DenseStats:
        return DenseStats(
            count=int(d["count"]), total=float(d["total"]), squares=float(d["squares"]),
            low=float("inf") if d["min"] is None else float(d["min"]),
            high=float("-inf") if d["max"] is None else float(d["max"]),
            negative=int(d["negative"]), bins=np.asarray(d["bins"], dtype=np.int64))


def _bin(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        k = np.floor(4 * np.log2(1 + np.abs(x)))
    return np.minimum(k, _BINS - 1).astype(np.int64)


def apply_transform(x: np.ndarray, kind: str, stats: DenseStats | None = None) -> np.ndarray:
    """``x`` [n] float32 transformed as ``kind`` says (float32 out; see the module docstring)."""
    if kind == "none":
        return x
    if kind == "log1p":
        return np.log1p(np.maximum(x, np.float32(0)))
    if kind == "standardize":
        if stats is None:
            raise ValueError("standardize needs the column's statistics")
        std = stats.std if stats.std > 0 else 1.0
        return ((x - np.float32(stats.mean)) / np.float32(std)).astype(np.float32, copy=False)
    raise ValueError(f"unknown dense transform {kind!r}")
