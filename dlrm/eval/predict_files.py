"""``dlrm predict``: the scores of Parquet rows that need no label (tomorrow's
impressions), written beside columns of the data.

    dlrm predict --checkpoint RUN --data PATH --out FILE.parquet [--keep id,hour]

    FILE.parquet    [kept columns, as in the data]  score (float64)
                    (a kept column of other types in other files: the type holding all)
                    one row per data row, in the data's order: file by file, row group by
                    row group, as the files list them

Each row group is read (the run's feature columns and the kept ones; a label column,
if there is one, is not read), scored by a :class:`~dlrm.eval.scorer.Scorer` and
written before the next is read: memory is one row group and the model, whatever the
data's size. One process (no torchrun), on ``device``. A bad value stops it in one line
naming the file, column, row group and row, and nothing is written (the file is
written under a temporary name and renamed at the end).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import atomic_path
from data.errors import DataError, UserError
from data.files import expand_paths, footer, open_parquet
from dlrm.eval.scorer import Scorer


def predict_files(run: str | Path, data: str, out: str | Path, keep: list[str],
                  device: str = "auto", strict_ids: bool = False) -> dict[str, Any]:
    """Write ``out`` (see the module docstring); what was written."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    files = expand_paths(data)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with Scorer(run, device, strict_ids) as scorer:
        schema = scorer.schema
        features = [c for c in schema.columns if c != schema.label]
        if "score" in keep:
            raise UserError("--keep score: the file written has a 'score' column itself, the scores; keep others")
        fields = _kept_fields(files, keep)
        out_schema = pa.schema([*fields, pa.field("score", pa.float64())])
        # single-hot string columns read dictionary-encoded, as the reader reads them (each
        # distinct value mapped once); not a kept one, which is written as the data has it
        strings = [f.name for f in schema.sparse if f.encoding != "identity" and not f.multi_hot
                   and f.name not in keep]
        final = Path(out)
        final.parent.mkdir(parents=True, exist_ok=True)
        rows = 0
        with atomic_path(final) as tmp, pq.ParquetWriter(str(tmp), out_schema) as writer:
            for path in files:
                pf = open_parquet(path, read_dictionary=strings)
                for name in features + keep:
                    if pf.schema_arrow.get_field_index(name) < 0:
                        raise DataError("column is missing", file=path, column=name)
                for g, row0 in _row_groups(pf):
                    table = pf.read_row_group(g, columns=list(dict.fromkeys(features + keep)))
                    scores = _scored(scorer, table, path, g, row0)
                    kept = [table.column(f.name).cast(f.type) for f in fields]
                    writer.write_table(pa.table([*kept, pa.array(scores)], schema=out_schema))
                    rows += table.num_rows
    return {"out": str(final), "rows": rows, "files": len(files), "device": device,
            "unseen_ids": scorer.unseen_ids}


def _kept_fields(files: list[str], keep: list[str]) -> list[Any]:
    """The kept columns as the output file holds them: each one's type in every file,
    widened where files differ (int32 in one, int64 in another: int64; the first file's
    type failed the others' values); one line for a column missing from a file or of
    types no one type holds (int and string)."""
    import pyarrow as pa

    schemas = []
    for path in files:
        schema = footer(path).schema_arrow
        for name in keep:
            if schema.get_field_index(name) < 0:
                raise DataError("column is missing (named by --keep)", file=path, column=name)
        fields = [schema.field(n) for n in keep]
        schemas.append(pa.schema([f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f
                                  for f in fields]))
    try:
        return list(pa.unify_schemas(schemas, promote_options="permissive"))
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        for name in keep:
            types: dict[str, str] = {}  # each type, and the first file holding it
            for schema, path in zip(schemas, files, strict=True):
                types.setdefault(str(schema.field(name).type), path)
            if len(types) > 1:
                (a, first), (b, other) = list(types.items())[:2]
                raise DataError(f"column kept by --keep is {a} in {first} and {b} here: no one type "
                                "holds both", file=other, column=name) from None
        raise


def _row_groups(pf: Any) -> list[tuple[int, int]]:
    """(row group, index within the file of its first row) of each row group."""
    out, at = [], 0
    for g in range(pf.metadata.num_row_groups):
        out.append((g, at))
        at += pf.metadata.row_group(g).num_rows
    return out


def _scored(scorer: Scorer, table: Any, path: str, group: int, row0: int) -> Any:
    """The row group's scores; a bad value named where it is in the files."""
    try:
        return scorer.score(table)
    except DataError as e:
        if e.file is not None:
            raise
        row = None if e.row is None else row0 + e.row
        raise DataError(e.reason, file=path, column=e.column, row_group=group, row=row) from None
