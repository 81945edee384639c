"""What the columns of a dataset mean: label, dense features, sparse features.

A sparse feature is an int64 column (one id per row, "single-hot") or a
list<int64> column (a bag of ids, "multi-hot"); each feeds one embedding table of
``rows`` rows. Default layout is Criteo's ``label, I1..I13, C1..C26``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SparseFeature:
    """One sparse column and the embedding table that serves it."""

    name: str
    rows: int
    table: str = ""  # table name; empty means "same as the column name"
    multi_hot: bool = False

    @property
    def table_name(self) -> str:
        return self.table or self.name


@dataclass(frozen=True)
class Schema:
    label: str = "label"
    dense: tuple[str, ...] = ()
    sparse: tuple[SparseFeature, ...] = field(default_factory=tuple)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.sparse_names]


CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))


def criteo_schema(rows: int | list[int], multi_hot: bool = False) -> Schema:
    """Criteo's layout; ``rows`` is one row count for all 26 tables or one per table."""
    counts = [rows] * len(CRITEO_SPARSE) if isinstance(rows, int) else list(rows)
    if len(counts) != len(CRITEO_SPARSE):
        raise ValueError(f"criteo_schema needs 26 row counts, got {len(counts)}")
    return Schema(
        label="label",
        dense=CRITEO_DENSE,
        sparse=tuple(
            SparseFeature(name=c, rows=n, multi_hot=multi_hot)
            for c, n in zip(CRITEO_SPARSE, counts)
        ),
    )
