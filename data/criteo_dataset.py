"""``dlrm convert-criteo``: Criteo TSV → a train and an eval Parquet set that train well.

    inputs ──parse (data.criteo)──► OUT/.staging/  raw ids h + 1 (or hashed), log1p dense
           ──count the train rows─► per column: value → count     (data.criteo_vocab)
           ──map ids, split───────► OUT/train/part-*.parquet, OUT/eval/part-*.parquet
    jobs:    one per input            one per column                one per output part
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
``dlrm convert-criteo`` first puts a shell glob's text-sorted list in day order;
MLPerf evaluates on day_23); ``eval_fraction=f`` the last round(f * N) rows in input
order (Criteo's files are in time order, so eval is the later traffic, as the DLRM
reference holds out the end of Kaggle's week); neither writes one set into OUT.
Every file is written atomically; the staging copy is removed at the end, also on
failure. Each input is parsed into its own staging parts, and each output part
written, as one job of ``workers`` processes (data/criteo_pool.py): the parts of a
set are cut at every ``file_rows`` rows, and where the inputs are moved into place
as parsed (``raw`` and ``hash`` ids without ``eval_fraction``) each input's last
part may be shorter.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

from data.criteo_pool import run_all
from data.errors import UserError
from data.schema import CRITEO_SPARSE

if TYPE_CHECKING:
    import pyarrow as pa

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
    workers: int = 0,
) -> dict:
    """Convert, map and split; write ``OUT/criteo.json`` and return what it holds.
    ``workers`` processes (0: one per core) parse the inputs, count the columns and
    write the parts, at most one per job (data/criteo_pool.py)."""
    _check(inputs, ids, min_frequency, max_ind_range, eval_days, eval_fraction)
    workers = workers or os.cpu_count() or 1  # run_all uses no more than a stage has jobs
    hash_range = max_ind_range if ids == "hash" else 0
    split = bool(eval_days or eval_fraction)
    staging = os.path.join(out_dir, ".staging")
    try:
        parsed = run_all([(_parse, (path, os.path.join(staging, f"{i:05d}"), hash_range, row_group_rows,
                                    file_rows)) for i, path in enumerate(inputs)], workers)
        head = [f for part in parsed[: len(inputs) - eval_days] for f in part]
        tail = [f for part in parsed[len(inputs) - eval_days :] for f in part]
        if ids != "vocabulary" and not eval_fraction:  # parsed as they stay: moved into place
            places = [("train", head), ("eval", tail)] if split else [("", head)]
            sets = {name: _place(files, os.path.join(out_dir, name)) for name, files in places}
            return _summary(out_dir, sets, None, ids, min_frequency)
        files = head + tail
        starts = _starts(files)
        total = starts[-1]
        n_train = starts[len(head)] - (round(eval_fraction * total) if eval_fraction else 0)
        if split and not 0 < n_train < total:
            raise UserError(f"the split leaves {n_train} train and {total - n_train} eval rows "
                            f"of {total}: give more rows or another --eval-fraction")
        saved = os.path.join(staging, "vocab") if ids == "vocabulary" else None
        rows = _fit(files, starts, n_train, min_frequency, saved, workers) if saved else None
        sets = {}
        for name, lo, hi in ([("train", 0, n_train), ("eval", n_train, total)] if split
                             else [("", 0, total)]):
            sets[name] = _write(files, starts, lo, hi, saved, os.path.join(out_dir, name),
                                row_group_rows, file_rows, workers)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _summary(out_dir, sets, rows, ids, min_frequency)


def _parse(path: str, staging: str, hash_range: int, row_group_rows: int, file_rows: int
           ) -> list[str]:
    """One input parsed into its own staging directory (a job of data/criteo_pool.py)."""
    from data.criteo import convert_criteo

    return convert_criteo([path], staging, hash_range, row_group_rows, file_rows)


def in_day_order(inputs: list[str]) -> tuple[list[str], str | None]:
    """The inputs in day order, and a note when that changed them. The shell sorts a
    glob's names as text (``day_*``: day_0, day_1, day_10, ..., day_9), which would hold
    out day_9 under ``--eval-days 1`` where Criteo 1TB's users want day_23: a text-sorted
    list whose numbers are out of order is put in number order. Any other order is the
    user's own and is kept."""
    from data.files import natural_key

    by_number = sorted(inputs, key=natural_key)
    if not _text_sorted(inputs) or by_number == inputs:
        return list(inputs), None
    names = [os.path.basename(x) for x in by_number]
    return by_number, (f"note: inputs taken in day order ({names[0]}, ..., {names[-1]}); the "
                       f"shell's glob had sorted them as text ({os.path.basename(inputs[-1])} last)")


def _text_sorted(inputs: list[str]) -> bool:
    """Whether ``inputs`` are in a shell glob's order: the C locale's (bytes) or that of a
    locale such as en_US.UTF-8, whose first level passes over punctuation: it lists
    ``day_10.gz`` before ``day_1.gz`` ('0' before 'g'), which byte order does not."""
    letters = [re.sub(r"[\W_]+", "", x).casefold() for x in inputs]
    return inputs == sorted(inputs) or letters == sorted(letters)


def held_out_note(inputs: list[str], eval_days: int) -> str | None:
    """Which inputs ``--eval-days`` holds out, named (a wrong order is seen at once)."""
    if not 0 < eval_days < len(inputs):  # none, or refused by _check
        return None
    return f"note: --eval-days {eval_days} holds out {', '.join(map(os.path.basename, inputs[-eval_days:]))}"


def _place(parts: list[str], out_dir: str) -> list[str]:
    """Staged parts renamed into ``out_dir`` as its part-NNNNN, in order."""
    from data.files import remove_stale_parts

    os.makedirs(out_dir, exist_ok=True)
    placed = []
    for i, path in enumerate(parts):
        placed.append(os.path.join(out_dir, f"part-{i:05d}.parquet"))
        os.replace(path, placed[-1])
    remove_stale_parts(out_dir, len(placed))
    return placed


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
    return _starts(files)[-1]


def _starts(files: list[str]) -> list[int]:
    """Each file's first row in the files read as one sequence, then the total."""
    import pyarrow.parquet as pq

    starts = [0]
    for f in files:
        starts.append(starts[-1] + pq.ParquetFile(f).metadata.num_rows)
    return starts


def _slices(files: list[str], starts: list[int], lo: int, hi: int,
            columns: list[str] | None = None) -> Iterator[pa.Table]:
    """Rows [lo, hi) of ``files`` read as one sequence (``starts``: :func:`_starts`), a
    row group at a time; files wholly outside are not opened."""
    import pyarrow.parquet as pq

    for path, start, end in zip(files, starts, starts[1:]):
        if end <= lo or start >= hi:
            continue
        pf = pq.ParquetFile(path)
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            a, b = max(lo - start, 0), min(hi - start, n)
            if a < b:
                yield pf.read_row_group(g, columns=columns).slice(a, b - a)
            start += n


def _fit(files: list[str], starts: list[int], n_train: int, min_frequency: int, prefix: str,
         workers: int) -> dict[str, int]:
    """One vocabulary per categorical column, from the train rows only, saved at
    ``prefix-COLUMN`` (FrequencyVocabulary.save); each table's rows. A column is one
    job (data/criteo_pool.py): it reads only its column chunks, and holds only its
    own distinct values, so the jobs need no merge."""
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    jobs = [(_fit_column, (files, starts, n_train, c, min_frequency, f"{prefix}-{c}"))
            for c in CRITEO_SPARSE]
    return dict(zip(CRITEO_SPARSE, run_all(jobs, workers), strict=True))


def _fit_column(files: list[str], starts: list[int], n_train: int, column: str,
                min_frequency: int, path: str) -> int:
    from data.criteo_vocab import FrequencyVocabulary, count_ids

    values, counts = count_ids(_slices(files, starts, 0, n_train, [column]), [column])[column]
    vocab = FrequencyVocabulary(values, counts, min_frequency)
    vocab.save(path)
    return vocab.rows


def _write(files: list[str], starts: list[int], lo: int, hi: int, vocab: str | None,
           out_dir: str, row_group_rows: int, file_rows: int, workers: int) -> list[str]:
    """Rows [lo, hi) of the staged files, ids mapped by the vocabulary saved at
    ``vocab`` if given, into out_dir: part k holds rows lo + k * file_rows on, one job
    each (data/criteo_pool.py)."""
    from data.files import remove_stale_parts

    cuts = list(range(lo, hi, file_rows)) + [hi]
    jobs = [(_write_part, (files, starts, a, b, vocab, out_dir, k, row_group_rows))
            for k, (a, b) in enumerate(itertools.pairwise(cuts))]
    os.makedirs(out_dir, exist_ok=True)
    try:
        written = run_all(jobs, workers)
    except BaseException:  # no dataset that looks complete, no temporary files
        for name in os.listdir(out_dir):
            if name.startswith((".part-", "part-")):
                os.remove(os.path.join(out_dir, name))
        raise
    remove_stale_parts(out_dir, len(written))
    return written


def _write_part(files: list[str], starts: list[int], lo: int, hi: int, vocab: str | None,
                out_dir: str, index: int, row_group_rows: int) -> str:
    """Output part ``index``: rows [lo, hi), mapped (a job of data/criteo_pool.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.criteo_vocab import FrequencyVocabulary
    from data.files import write_parts

    maps = {c: FrequencyVocabulary.load(f"{vocab}-{c}") for c in CRITEO_SPARSE} if vocab else {}

    def mapped() -> Iterator[pa.Table]:
        for table in _slices(files, starts, lo, hi):
            for c, v in maps.items():
                i = table.schema.get_field_index(c)
                table = table.set_column(i, c, pa.array(v.map(table.column(c).to_numpy())))
            yield table

    schema = pq.read_schema(files[0])
    return write_parts(out_dir, mapped(), schema, hi - lo, row_group_rows, first=index, prune=False)[0]


def _summary(out_dir: str, sets: dict[str, list[str]],
             table_rows: dict[str, int] | None, ids: str, min_frequency: int
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
    if table_rows is not None:
        summary["min_frequency"] = min_frequency
        summary["table_rows"] = table_rows
    elif ids == "raw":
        summary["table_rows"] = ("raw hashed ids: dlrm train builds a vocabulary from "
                                 "data.train (data.encoding=auto)")
    train = paths.get("train", paths.get("data"))
    summary["train"] = (f"dlrm train --config configs/criteo_kaggle.yaml data.train={train}"
                        + (f" data.eval={paths['eval']}" if "eval" in paths else ""))
    write_atomic(os.path.join(out_dir, "criteo.json"), json.dumps(summary, indent=1) + "\n")
    return summary
