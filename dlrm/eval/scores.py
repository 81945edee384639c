"""``dlrm eval --scores FILE``: every eval row's score, for analysis the metrics do not
cover (AUC per segment, two models row by row, a calibration fit).

    FILE.parquet    [--keep columns, as in the data]  score (float64)  label (float32)
                    one row per eval row, in the data's order: file by file, row group
                    by row group, as the files list them

The eval reader reads without shuffling, each rank a contiguous range of the stream
(data/reader.py), and the scores are gathered rank after rank: the gathered scores are
the stream's order at any world size. The kept columns are read from the same files,
row group by row group, and written beside them (memory: one row group). A run whose
``data.on_error=skip`` dropped rows has fewer scores than rows: no order to keep them
in, so the file is refused in one line. Written under a temporary name and renamed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.atomic import atomic_path
from data.errors import DataError, UserError
from data.files import footer, open_parquet

RESERVED = ("score", "label")


def check_keep(files: list[str], keep: list[str], label: str) -> None:
    """Every kept column is in the first file and is not one the file writes itself."""
    for name in keep:
        if name in RESERVED:
            raise UserError(f"--keep {name}: the scores file writes a {name!r} column itself; keep others")
        if name == label:
            raise UserError(f"--keep {name}: the label, which the scores file writes as 'label'; keep others")
        if footer(files[0]).schema_arrow.get_field_index(name) < 0:
            raise DataError("column is missing (named by --keep)", file=files[0], column=name)


def write_scores(path: str | Path, files: list[str], scores: np.ndarray, labels: np.ndarray,
                 keep: list[str]) -> str:
    """Write the scores file (see the module docstring); its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sum(footer(f).metadata.num_rows for f in files)
    if rows != len(scores):
        raise UserError(f"--scores: {len(scores):,} rows were scored of the data's {rows:,} "
                        "(data.on_error=skip dropped some): the scores cannot be put in the "
                        "data's order; evaluate without --scores, or fix the data")
    fields = [pa.field(n, footer(files[0]).schema_arrow.field(n).type) for n in keep]
    schema = pa.schema([*fields, pa.field("score", pa.float64()), pa.field("label", pa.float32())])
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(final) as tmp, pq.ParquetWriter(str(tmp), schema) as writer:
        at = 0
        for f in files:
            pf = open_parquet(f)
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                kept = pf.read_row_group(g, columns=keep).columns if keep else []
                writer.write_table(pa.table(
                    [*kept, pa.array(scores[at:at + n]), pa.array(labels[at:at + n].astype(np.float32))],
                    schema=schema))
                at += n
    return str(final)
