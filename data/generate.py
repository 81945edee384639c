"""Synthetic Criteo-like data: Zipf-popular ids and a planted logistic signal.

Written as Parquet, streamed in row groups, seeded and reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateConfig:
    """Synthetic Criteo-like data for ``dlrm generate``."""

    rows: int = 100_000
    dense: int = 13
    sparse: int = 26
    table_rows: list[int] = field(default_factory=lambda: [1000])  # one value, or one per table
    zipf: float = 1.05  # id popularity exponent (Criteo is about 1.05)
    multi_hot: int = 0  # how many of the sparse features are multi-hot bags
    max_bag: int = 5  # multi-hot bag lengths are uniform in [0, max_bag]
    signal: float = 1.0  # strength of the planted logistic signal
    row_group_rows: int = 65_536
    file_rows: int = 1_000_000
