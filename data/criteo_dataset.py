"""``dlrm convert-criteo``: Criteo TSV → a train and an eval Parquet set that train well.

    inputs ──parse (data.criteo)──► OUT/.staging/  raw ids h + 1 (or hashed), log1p dense
           ──count the train rows─► per column: value → count     (data.criteo_vocab)
           ──map ids, split───────► OUT/train/part-*.parquet, OUT/eval/part-*.parquet
                                    + OUT/criteo.json: rows, table sizes, how to train

Ids (``ids``):
  vocabulary  (default) 0 = empty, 1 = seen in the train rows fewer than
              ``min_frequency`` times or not at all, 2.. = the kept train values by
              falling count: a table has (kept values + 2) rows, and no eval id needs a
              row the train set lacks
  raw         h + 1 as data.criteo writes it; ``dlrm train`` then builds the vocabulary
              itself (``data.encoding=auto``), from data.train
  hash        h % (R - 1) + 1 with ``max_ind_range`` R: the DLRM/MLPerf reference's ids

Split: ``eval_days=K`` holds out the last K inputs (Criteo 1TB has one file per day;
MLPerf evaluates on day_23); ``eval_fraction=f`` the last round(f * N) rows in input
order (Criteo's files are in time order, so eval is the later traffic, as the DLRM
reference holds out the end of Kaggle's week); neither writes one set into OUT.
Every file is written atomically; the staging copy is removed at the end, also on
failure.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

from data.errors import UserError
from data.schema import CRITEO_SPARSE

if TYPE_CHECKING:
    import pyarrow as pa

    from data.criteo_vocab import FrequencyVocabulary

IDS = ("vocabulary", "raw", "hash")
DENSE_NOTE = ("the converter wrote log(1 + max(x, 0)) for I1..I13: train with "
              "data.dense_transform=none (the default)")


def convert_criteo_dataset(
    inputs: list[str],
    out_dir: str,
    *,
    ids: str = "vocabulary",
    min_frequency: int = 1,
    max_ind_range: int = 0,
    eval_days: int = 0,
    eval_fraction: float = 0.0,
    row_group_rows: int = 65536,
    file_rows: int = 1_000_000,
) -> dict:
    """Convert, map and split; write ``OUT/criteo.json`` and return what it holds."""
    from data.criteo import convert_criteo

    _check(inputs, ids, min_frequency, max_ind_range, eval_days, eval_fraction)
    hash_range = max_ind_range if ids == "hash" else 0
    split = bool(eval_days or eval_fraction)
    if ids != "vocabulary" and not eval_fraction:  # one parse straight into place
        places = [("train", inputs[: len(inputs) - eval_days]), ("eval", inputs[-eval_days:])]
        sets = {name: convert_criteo(part, os.path.join(out_dir, name), hash_range,
                                     row_group_rows, file_rows)
                for name, part in (places if split else [("", inputs)])}
        return _summary(out_dir, sets, None, ids, min_frequency)
    staging = os.path.join(out_dir, ".staging")
    try:
        head = convert_criteo(inputs[: len(inputs) - eval_days], os.path.join(staging, "a"),
                              hash_range, row_group_rows, file_rows)
        tail = convert_criteo(inputs[len(inputs) - eval_days :], os.path.join(staging, "b"),
                              hash_range, row_group_rows, file_rows) if eval_days else []
        files = head + tail
        total = _rows(files)
        n_train = _rows(head) - (round(eval_fraction * total) if eval_fraction else 0)
        if split and not 0 < n_train < total:
            raise UserError(f"the split leaves {n_train} train and {total - n_train} eval rows "
                            f"of {total}: give more rows or another --eval-fraction")
        vocab = _fit(files, n_train, min_frequency) if ids == "vocabulary" else None
        sets = {}
        for name, lo, hi in ([("train", 0, n_train), ("eval", n_train, total)] if split
                             else [("", 0, total)]):
            sets[name] = _write(files, lo, hi, vocab, os.path.join(out_dir, name),
                                row_group_rows, file_rows)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _summary(out_dir, sets, vocab, ids, min_frequency)


def _check(inputs: list[str], ids: str, min_frequency: int, max_ind_range: int,
           eval_days: int, eval_fraction: float) -> None:
    """Each bad argument is one line naming its flag."""
    checks = [
        (not (eval_days and eval_fraction), "give --eval-days or --eval-fraction, not both"),
        (ids in IDS, f"--ids {ids!r} is not one of {', '.join(IDS)}"),
        (ids != "hash" or max_ind_range >= 2, "--ids hash needs --max-ind-range R >= 2"),
        (ids == "hash" or not max_ind_range, f"--max-ind-range goes with --ids hash, not {ids}"),
        (min_frequency >= 1, f"--min-frequency {min_frequency} must be >= 1"),
        (0 <= eval_days < len(inputs) or not eval_days,
         f"--eval-days {eval_days} must leave one of the {len(inputs)} input(s) to train on"),
        (0.0 <= eval_fraction < 1.0 and math.isfinite(eval_fraction),
         f"--eval-fraction {eval_fraction} must be in [0, 1)"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def _rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _slices(files: list[str], lo: int, hi: int, columns: list[str] | None = None
            ) -> Iterator[pa.Table]:
    """Rows [lo, hi) of ``files`` read as one sequence, a row group at a time."""
    import pyarrow.parquet as pq

    start = 0
    for path in files:
        pf = pq.ParquetFile(path)
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            a, b = max(lo - start, 0), min(hi - start, n)
            if a < b:
                yield pf.read_row_group(g, columns=columns).slice(a, b - a)
            start += n
            if start >= hi:
                return


def _fit(files: list[str], n_train: int, min_frequency: int
         ) -> dict[str, FrequencyVocabulary]:
    """One vocabulary per categorical column, from the train rows only."""
    from data.criteo_vocab import FrequencyVocabulary, count_ids

    counts = count_ids(_slices(files, 0, n_train, CRITEO_SPARSE), CRITEO_SPARSE)
    return {c: FrequencyVocabulary(v, n, min_frequency) for c, (v, n) in counts.items()}


def _write(files: list[str], lo: int, hi: int, vocab: dict[str, FrequencyVocabulary] | None,
           out_dir: str, row_group_rows: int, file_rows: int) -> list[str]:
    """Rows [lo, hi) of the staged files, ids mapped by ``vocab`` if given, into out_dir."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.files import write_parts

    def mapped() -> Iterator[pa.Table]:
        for table in _slices(files, lo, hi):
            if vocab is not None:
                for c, v in vocab.items():
                    i = table.schema.get_field_index(c)
                    table = table.set_column(i, c, pa.array(v.map(table.column(c).to_numpy())))
            yield table

    schema = pq.read_schema(files[0])
    return write_parts(out_dir, mapped(), schema, file_rows, row_group_rows)


def _summary(out_dir: str, sets: dict[str, list[str]],
             vocab: dict[str, FrequencyVocabulary] | None, ids: str, min_frequency: int
             ) -> dict:
    """What was written and how to train on it; saved as OUT/criteo.json."""
    from data.atomic import write_atomic

    paths = {name or "data": os.path.join(out_dir, name) if name else out_dir for name in sets}
    summary: dict = {
        "out": out_dir,
        "sets": {k: {"path": paths[k], "files": len(sets[n]), "rows": _rows(sets[n])}
                 for k, n in zip(paths, sets, strict=True)},
        "ids": ids,
        "dense": DENSE_NOTE,
    }
    if vocab is not None:
        summary["min_frequency"] = min_frequency
        summary["table_rows"] = {c: v.rows for c, v in vocab.items()}
    elif ids == "raw":
        summary["table_rows"] = ("raw hashed ids: dlrm train builds a vocabulary from "
                                 "data.train (data.encoding=auto)")
    train = paths.get("train", paths.get("data"))
    summary["train"] = (f"dlrm train --config configs/criteo_kaggle.yaml data.train={train}"
                        + (f" data.eval={paths['eval']}" if "eval" in paths else ""))
    write_atomic(os.path.join(out_dir, "criteo.json"), json.dumps(summary, indent=1) + "\n")
    return summary
