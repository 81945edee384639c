"""A run's preprocessing: how categorical values become rows, how dense values change.

    data.train ──one pass (fit)──► Preprocessing ──save──► RUN/preprocessing.json
                                                           RUN/preprocessing/vocab-K.parquet
    reader: column ──Preprocessing.ids / .dense──► rows, transformed dense values

Each table has one encoding (data.encoding, data.encodings per column):

* ``identity``: the int id is the row (table rows = max id + 1, as before).
* ``vocabulary``: :class:`data.vocabulary.Vocabulary`; row 0 = out-of-vocabulary (values
  rarer than data.min_frequency, cut by data.max_rows or data.rows[column], unseen in
  training, null).
* ``hash``: row = 1 + splitmix64(key) % (rows - 1), key = the int or the stable hash
  of the bytes; rows = data.rows[column] or data.hash_rows; row 0 = null. No pass.
* ``auto``: vocabulary for strings, binary and dictionaries; for ints, identity unless
  the footers' min is negative or max id + 1 > 2^20 (and data.rows does not size the
  column): such a column is counted in the pass and gets a vocabulary when its distinct
  values fill less than half of max id + 1 (Criteo's hashed ids up to 4.29e9).

The pass reads, row group by row group, the counted columns and the dense columns
(statistics for standardize and for the raw-count warning). With nothing to count and
no standardize it reads only the first 2^20 rows, for the warning.

Every rank fits the same preprocessing from the same files (the result depends only on
the data, not on the order it was read in), a resumed run loads the saved one and
never refits, and each checkpoint's meta.json holds the sha256 of preprocessing.json.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.dense_transform import DenseStats, apply_transform
from data.errors import DataError, UserError, one_line, quoted
from data.fit_exchange import Exchange
from data.fit_settings import recorded
from data.fit_split import Split, count_split
from data.hashing import splitmix64
from data.int_counts import plain_numpy
from data.schema import (
    Schema,
    SparseFeature,
    column_types,
    exemplar,
    id_ranges,
    is_categorical,
    type_name,
)
from data.vocabulary import ValueCounter, Vocabulary, flat_values, value_keys

FILE = "preprocessing.json"
VOCAB_DIR = "preprocessing"
AUTO_IDENTITY_ROWS = 1 << 20
SAMPLE_ROWS = 1 << 20


@dataclass
class Options:
    """The data.* settings the preprocessing follows (see dlrm/config.py DataConfig)."""

    encoding: str = "auto"
    encodings: dict[str, str] = field(default_factory=dict)
    min_frequency: int = 1
    max_rows: int = 0
    hash_rows: int = 1 << 20
    rows: dict[str, int] = field(default_factory=dict)  # data.rows: per feature
    dense_transform: str = "none"
    dense_transforms: dict[str, str] = field(default_factory=dict)
    on_error: str = "fail"  # skip: a row group that cannot be read is left out of the pass
    workers: int = 0  # data.fit_workers: processes counting disjoint row groups
    sketch: bool = True  # data.fit_sketch: min_frequency > 1 pre-filter (data/fit_sketch.py)
    rank: int = 0  # this rank of world: counts row groups[rank::world]
    world: int = 1
    gather: Callable[[object], list[object]] | None = None  # every rank's object, rank order
    exchange: Exchange | None = None  # int64 arrays all-to-all (data/fit_exchange.py)
    progress: bool = False  # a progress bar (tqdm, on a terminal) over the pass


@dataclass
class Preprocessing:
    """What ``fit`` found; ``apply`` puts each table's encoding and rows into a Schema."""

    encodings: dict[str, str]  # table → identity | vocabulary | hash
    rows: dict[str, int]  # table → rows (vocabulary and hash tables)
    vocabularies: dict[str, Vocabulary]
    transforms: dict[str, str]  # dense column → transform
    stats: dict[str, DenseStats]
    stats_rows: int  # rows the dense statistics were taken over
    notes: list[str] = field(default_factory=list)  # lines to show at the start of a run
    data: dict[str, str] = field(default_factory=dict)  # file fitted over → footer sha256
    settings: dict[str, object] = field(default_factory=dict)  # data/fit_settings.py ``recorded``

    def apply(self, schema: Schema) -> Schema:
        """``schema`` with each sparse feature's encoding and, if not identity, rows."""
        out = []
        for f in schema.sparse:
            enc = self.encodings.get(f.table_name, "identity")
            rows = self.rows[f.table_name] if enc != "identity" else f.rows
            out.append(SparseFeature(f.name, rows, f.table, f.multi_hot, enc))
        return Schema(schema.label, schema.dense, tuple(out))

    def ids(self, feature: SparseFeature, col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of a vocabulary or hash feature's column: (values, offsets or None)."""
        if not feature.multi_hot and pa.types.is_dictionary(col.type):
            return self._dictionary_ids(feature, col), None
        values, offsets = flat_values(col)
        return self._rows(feature, values), offsets

    def _rows(self, feature: SparseFeature, values: pa.Array, distinct: bool = False) -> np.ndarray:
        """Rows [n] of flat ``values`` (``distinct``: no value repeats)."""
        if feature.encoding == "vocabulary":
            vocab = self.vocabularies[feature.table_name]
            if pa.types.is_integer(vocab.values.type) != pa.types.is_integer(values.type):
                raise DataError(f"type {values.type} here, {vocab.values.type} in the data its "
                                "vocabulary was fitted on", column=feature.name)
            return vocab.lookup(values, distinct)
        if feature.encoding != "hash":
            raise ValueError(f"feature {feature.name}: encoding {feature.encoding} maps no values")
        return hash_rows(values, feature.rows)

    def _dictionary_ids(self, feature: SparseFeature, col: pa.ChunkedArray) -> np.ndarray:
        """Rows [n] of a dictionary-encoded single-hot column (strings read with
        ``read_dictionary``): each chunk's dictionary (its values, as the file wrote
        them) mapped once, then one gather by the chunk's indices; a null is row 0.
        No Python per value."""
        out = np.empty(len(col), np.int64)
        at = 0
        for chunk in col.chunks:
            rows = np.append(self._rows(feature, flat_values(chunk.dictionary)[0], True), 0)
            indices = chunk.indices
            if indices.null_count:
                if indices.type.bit_width < 32:  # room for the null's index (int8: 128 values)
                    indices = indices.cast(pa.int32())
                indices = pc.fill_null(indices, len(rows) - 1)  # null: the 0 after the rows
            indices = indices.to_numpy()
            np.take(rows, indices, out=out[at : at + len(chunk)], mode="clip")
            at += len(chunk)
        return out

    def dense(self, name: str, x: np.ndarray) -> np.ndarray:
        return apply_transform(x, self.transforms.get(name, "none"), self.stats.get(name))


def hash_rows(values: pa.Array, rows: int) -> np.ndarray:
    """1 + splitmix64(key) % (rows - 1) for each value, 0 for nulls (rows >= 2); each
    distinct value of the batch is hashed once."""
    if len(values) == 0 or values.null_count == len(values):
        return np.zeros(len(values), dtype=np.int64)
    encoded = pc.dictionary_encode(values)
    keys = splitmix64(value_keys(encoded.dictionary))
    buckets = (keys % np.uint64(rows - 1)).astype(np.int64) + 1
    indices = pc.fill_null(encoded.indices, -1).to_numpy().astype(np.int64)
    return np.where(indices >= 0, buckets[indices], 0)


# --------------------------------------------------------------------------- fitting


def fit(files: list[str], schema: Schema, opts: Options) -> Preprocessing:
    """The preprocessing of ``schema``'s columns over ``files`` (one pass at most)."""
    start = time.perf_counter()
    kinds = column_types(exemplar(files), [f.name for f in schema.sparse])
    choice = _table_encodings(schema, kinds, opts)
    ranges = id_ranges(files, [f.name for f in schema.sparse if choice[f.table_name] == "auto"])
    for table in [t for t, enc in choice.items() if enc == "auto"]:
        members = [f.name for f in schema.sparse if f.table_name == table]
        big = any(ranges[n][0] < 0 or ranges[n][1] + 1 > AUTO_IDENTITY_ROWS for n in members)
        choice[table] = "auto-count" if big else "identity"
    decided = _decide_auto(files, schema, choice, ranges, opts.on_error == "skip")
    counted = {t for t, enc in choice.items() if enc in ("vocabulary", "auto-count")}
    transforms = {n: opts.dense_transforms.get(n, opts.dense_transform) for n in schema.dense}
    full = bool(counted) or "standardize" in transforms.values()
    caps = {t: _cap(schema, t, opts) for t in counted}
    split = Split(opts.rank, opts.world, opts.gather, opts.workers, opts.min_frequency,
                  {t for t in counted if choice[t] == "vocabulary"} if opts.sketch else set(),
                  opts.progress, caps, opts.exchange)
    counters, stats, seen = _count(files, schema, counted, None if full else SAMPLE_ROWS,
                                   opts.on_error == "skip", split)
    prep = Preprocessing({}, {}, {}, transforms, stats, seen, data=footer_digests(files),
                         settings=recorded(opts))
    vocabs = _vocabularies(schema, kinds, counters, opts)
    for table, enc in choice.items():
        members = [f for f in schema.sparse if f.table_name == table]
        cap = _cap(schema, table, opts)
        if enc == "hash":
            prep.encodings[table], prep.rows[table] = "hash", max(cap or opts.hash_rows, 2)
        elif enc in ("vocabulary", "auto-count"):
            vocab = vocabs.pop(table)
            lo = min(ranges.get(f.name, (0, 0))[0] for f in members)
            hi = max(ranges.get(f.name, (0, 0))[1] for f in members)
            if enc == "auto-count" and lo >= 0 and 2 * vocab.distinct >= hi + 1:
                prep.encodings[table] = "identity"  # dense ids: the id is the row
                continue
            prep.encodings[table], prep.rows[table] = "vocabulary", vocab.rows
            prep.vocabularies[table] = vocab
        else:
            prep.encodings[table] = "identity"
    prep.notes = _notes(prep, seen, time.perf_counter() - start) + _identifier_notes(schema, prep, seen)
    prep.notes[:0] = [f"preprocessing: encoding=auto: table {t} {prep.encodings[t]} ({why})"
                      for t, why in sorted(decided.items())]
    return prep


def _vocabularies(schema: Schema, kinds: dict[str, pa.DataType],
                  counters: dict[str, ValueCounter], opts: Options) -> dict[str, Vocabulary]:
    """Each counted table's vocabulary. One at a time, each counter freed as its
    vocabulary is built; with ``data.fit_workers=N``, on N threads (the workers' cores
    are free by now, and numpy's sorts release the GIL)."""
    def build(table: str) -> Vocabulary:
        first = next(f.name for f in schema.sparse if f.table_name == table)
        return Vocabulary.of_counter(counters.pop(table), _value_type(kinds[first]),
                                     opts.min_frequency, _cap(schema, table, opts))

    tables = sorted(counters)
    if opts.workers <= 1:
        return {t: build(t) for t in tables}
    with ThreadPoolExecutor(opts.workers) as pool:
        return dict(zip(tables, pool.map(build, tables)))


def _cap(schema: Schema, table: str, opts: Options) -> int:
    """The rows a table may have: data.rows of its features, else data.max_rows (0: any)."""
    members = [f.name for f in schema.sparse if f.table_name == table]
    return max([opts.rows[n] for n in members if n in opts.rows] or [opts.max_rows])


def _decide_auto(files: list[str], schema: Schema, choice: dict[str, str],
                 ranges: dict[str, tuple[int, int]], skip: bool) -> dict[str, str]:
    """Settle ``auto-count`` tables (ints past 2^20 or negative) without a full pass
    where possible; table → what decided it. ``choice`` is updated: identity when the
    sample says the ids are dense, else left to the full pass (auto-count).

    Footers first: a negative id, or fewer rows in all than half of max id + 1 (too few
    to fill the range, whatever they hold), means a vocabulary. Else a sample of row
    groups spread over the files (:data:`SAMPLE_ROWS` rows) estimates the distinct
    count (Chao1: seen + f1^2 / 2 f2, a lower-bias estimate from the values seen once
    and twice); identity when twice that reaches max id + 1, as the full pass decides."""
    from data.files import footer

    auto = [t for t, enc in choice.items() if enc == "auto-count"]
    if not auto:
        return {}
    total = sum(footer(f).metadata.num_rows for f in files)
    why, sample = {}, []
    for table in auto:
        lo, hi = _table_range(schema, table, ranges)
        if lo < 0:
            why[table] = f"footers: min id {lo} < 0"
        elif 2 * total < hi + 1:
            why[table] = f"footers: {total} rows < half of max id + 1 = {hi + 1}"
        else:
            sample.append(table)
    if sample:
        counters, rows, groups = _sample(files, schema, sample, skip)
        for table in sample:
            lo, hi = _table_range(schema, table, ranges)
            est = min(_chao1(counters[table].table()), total)
            if 2 * est >= hi + 1:
                choice[table] = "identity"
            why[table] = (f"sample of {rows} rows in {groups} row groups: about {est} distinct "
                          f"{'>=' if 2 * est >= hi + 1 else '<'} half of max id + 1 = {hi + 1}")
    return why


def _table_range(schema: Schema, table: str, ranges: dict[str, tuple[int, int]]) -> tuple[int, int]:
    members = [f.name for f in schema.sparse if f.table_name == table]
    return min(ranges[n][0] for n in members), max(ranges[n][1] for n in members)


def _chao1(counted: pa.Table | None) -> int:
    if counted is None:
        return 0
    counts = counted["count"].to_numpy()
    f1, f2 = int((counts == 1).sum()), int((counts == 2).sum())
    return int(len(counts) + f1 * (f1 - 1) / (2 * (f2 + 1)))


def _sample(files: list[str], schema: Schema, tables: list[str], skip: bool
            ) -> tuple[dict[str, ValueCounter], int, int]:
    """Value counts of ``tables`` over row groups spread evenly over ``files`` until
    :data:`SAMPLE_ROWS` rows; (counters, rows, row groups read)."""
    from data.files import LastOpened, footer

    groups = []
    for f in files:
        md = footer(f).metadata
        groups += [(f, g, md.row_group(g).num_rows) for g in range(md.num_row_groups)
                   if md.row_group(g).num_rows]  # an empty one may type its columns null
    mean = max(sum(n for *_, n in groups) // max(len(groups), 1), 1)
    want = min(len(groups), -(-SAMPLE_ROWS // mean))
    picks = sorted({int(i * len(groups) / want) for i in range(want)}) if want else []
    columns = [f.name for f in schema.sparse if f.table_name in tables]
    counters = {t: ValueCounter() for t in tables}
    rows = read = 0
    opened = LastOpened()
    for i in picks:
        path, g, _ = groups[i]
        try:
            table = opened(path).read_row_group(g, columns=columns)
        except (pa.ArrowException, OSError) as e:
            if skip:
                continue
            raise DataError(f"cannot read ({quoted(e)})", file=path, row_group=g) from None
        rows, read = rows + table.num_rows, read + 1
        for f in schema.sparse:
            if f.table_name in tables:
                counters[f.table_name].add(flat_values(table.column(f.name))[0])
    return counters, rows, read


def _table_encodings(schema: Schema, kinds: dict[str, str], opts: Options) -> dict[str, str]:
    """table → identity | vocabulary | hash | auto (ints the footers decide), checked."""
    out: dict[str, str] = {}
    for f in schema.sparse:
        enc = opts.encodings.get(f.name, opts.encoding)
        if enc == "auto" and is_categorical(kinds[f.name]):
            enc = "vocabulary"
        if enc == "auto" and f.name in opts.rows:
            enc = "identity"  # the user sized the table: ids are rows (data.id_policy)
        if enc == "identity" and is_categorical(kinds[f.name]):
            raise UserError(f"data.encodings.{f.name}=identity: column {f.name!r} is "
                            f"{type_name(kinds[f.name])}, not integer (use vocabulary or hash)")
        if out.setdefault(f.table_name, enc) != enc:
            raise UserError(f"features of table {f.table_name!r} (data.tables) have different "
                            f"encodings ({out[f.table_name]}, {enc}): set one in data.encodings")
    return out


def _value_type(t: pa.DataType) -> pa.DataType:
    """The type a vocabulary of a column of type ``t`` holds (flat_values' types)."""
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.large_string()
    return pa.int64() if pa.types.is_integer(t) else pa.large_binary()


def _count(files: list[str], schema: Schema, tables: set[str], limit: int | None, skip: bool,
           split: Split | None = None
           ) -> tuple[dict[str, ValueCounter], dict[str, DenseStats], int]:
    """The pass: value counts of the counted tables' columns, dense statistics; rows read.
    ``skip``: row groups that cannot be read are left out (the reader reports them).
    A split over ranks or workers, or the sketch pre-filter: the pass is
    :func:`data.fit_split.count_split`, whose dense statistics add each row group's
    float sums in file order, as here (the same bits)."""
    from data.files import open_parquet

    split = split or Split()
    sketching = split.sketching(tables)
    if (split.workers > 0 or split.world > 1 or sketching) and tables and limit is None:
        return count_split(files, schema, tables, skip, split)
    counters = {t: ValueCounter() for t in tables}
    stats = {n: DenseStats() for n in schema.dense}
    columns = [f.name for f in schema.sparse if f.table_name in tables] + list(schema.dense)
    seen = 0
    bar = _bar(files, split.progress and bool(tables) and limit is None)
    for path in files:
        pf = open_parquet(path)
        for g in range(pf.metadata.num_row_groups):
            if limit is not None and seen >= limit:
                return counters, stats, seen
            if not columns or not pf.metadata.row_group(g).num_rows:  # counted from the footer
                seen += pf.metadata.row_group(g).num_rows  # (an empty group may type columns null)
                continue
            try:
                table = pf.read_row_group(g, columns=columns)
            except (pa.ArrowException, OSError) as e:
                if skip:
                    continue
                raise DataError(f"cannot read ({quoted(e)})", file=path, row_group=g) from None
            seen += table.num_rows
            for f in schema.sparse:
                if f.table_name in tables:
                    counters[f.table_name].add(flat_values(table.column(f.name))[0])
            for n in schema.dense:
                stats[n].add(plain_numpy(table.column(n)).astype(np.float32, copy=False))
            if bar is not None:
                bar.update(table.num_rows)
    if bar is not None:
        bar.close()
    return counters, stats, seen


def _bar(files: list[str], on: bool):
    """A tqdm bar over the footers' rows (rows/s, ETA), shown on a terminal only."""
    if not on:
        return None
    from tqdm import tqdm

    from data.files import footer

    total = sum(footer(f).metadata.num_rows for f in files)
    return tqdm(total=total, desc="fit: counting", unit=" rows", unit_scale=True, disable=None)


ID_SHARE = 0.9  # distinct values over rows counted, above which a column reads as a row id
ID_MIN_ROWS = 1000  # fewer rows say nothing: a small sample is nearly all distinct


def _identifier_notes(schema: Schema, prep: Preprocessing, seen: int) -> list[str]:
    """One warning naming single-hot columns whose values are (nearly) all distinct: a
    row id (Avazu's ``id``) trains one embedding per row that no eval row meets."""
    if seen < ID_MIN_ROWS:
        return []
    owners = Counter(f.table_name for f in schema.sparse)
    ids = [(f.name, prep.vocabularies[f.table_name].distinct) for f in schema.sparse
           if not f.multi_hot and owners[f.table_name] == 1 and f.table_name in prep.vocabularies
           and prep.vocabularies[f.table_name].distinct >= ID_SHARE * seen]
    if not ids:
        return []
    named = ", ".join(f"{name} ({distinct:,} distinct values in {seen:,} rows)" for name, distinct in ids)
    line = (f"warning: nearly every row has a value of its own in {named}: a row identifier trains "
            "one embedding per row that no eval row meets; leave it out with "
            f"data.exclude=[{','.join(name for name, _ in ids)}]")
    return [line]


def _notes(prep: Preprocessing, seen: int, seconds: float | None) -> list[str]:
    """One line on the vocabularies (fitted, or reused: ``seconds`` None), one on
    columns that look like raw counts."""
    notes = []
    if prep.vocabularies:
        sizes = ", ".join(f"{t} {v.rows}" for t, v in sorted(prep.vocabularies.items()))
        how = (f"fitted over {seen} rows in {seconds:.1f}s" if seconds is not None
               else f"reused from {FILE}")
        notes.append(f"preprocessing: vocabularies {how} (table rows incl. OOV row 0: {sizes})")
    raw = [n for n, s in prep.stats.items()
           if prep.transforms.get(n, "none") == "none" and s.looks_like_counts()]
    if raw:
        notes.append(f"dense columns {', '.join(raw)} look like raw counts (non-negative, max "
                     ">= 100x median): set data.dense_transform=log1p")
    return notes


# --------------------------------------------------------------------------- saving


def save(prep: Preprocessing, run_dir: Path) -> str:
    """Write RUN/preprocessing.json (last) and one Parquet file per vocabulary, each
    atomically; the sha256 of preprocessing.json."""
    import pyarrow.parquet as pq

    from data.atomic import atomic_path, write_atomic

    tables = {}
    for k, (table, vocab) in enumerate(sorted(prep.vocabularies.items())):
        name = f"{VOCAB_DIR}/vocab-{k}.parquet"
        (run_dir / VOCAB_DIR).mkdir(parents=True, exist_ok=True)
        with atomic_path(run_dir / name) as tmp:
            pq.write_table(pa.table({"value": vocab.values, "count": vocab.counts}), tmp)
        tables[table] = {"file": name, "sha256": _sha256(run_dir / name),
                         "distinct": vocab.distinct}
    body = {
        "version": 1,
        "encodings": prep.encodings, "rows": prep.rows, "vocabularies": tables,
        "dense": {n: {"transform": prep.transforms.get(n, "none"), "stats": s.to_json()}
                  for n, s in prep.stats.items()},
        "stats_rows": prep.stats_rows,
        "data": prep.data,
        "settings": prep.settings,
    }
    text = json.dumps(body, indent=1)
    write_atomic(run_dir / FILE, text)
    return hashlib.sha256(text.encode()).hexdigest()


def load(run_dir: Path, files: list[str] | None = None) -> Preprocessing:
    """The preprocessing saved in ``run_dir``, every vocabulary file checked by sha256;
    with ``files``, refused unless they are the files it was fitted over (by name and
    the sha256 of their Parquet footers: :func:`check_data`)."""
    import pyarrow.parquet as pq

    path = Path(run_dir) / FILE
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read ({str(e).splitlines()[0]})") from None
    vocabs = {}
    for table, entry in body["vocabularies"].items():
        file = Path(run_dir) / entry["file"]
        if not file.is_file() or _sha256(file) != entry["sha256"]:
            raise UserError(f"{file}: missing or altered since the run saved it (sha256)")
        t = pq.read_table(file)
        vocabs[table] = Vocabulary(t["value"].combine_chunks(), t["count"].to_numpy(),
                                   int(entry["distinct"]))
    prep = Preprocessing(
        body["encodings"], {k: int(v) for k, v in body["rows"].items()}, vocabs,
        {n: d["transform"] for n, d in body["dense"].items()},
        {n: DenseStats.from_json(d["stats"]) for n, d in body["dense"].items()},
        int(body["stats_rows"]), data=dict(body.get("data", {})), settings=dict(body.get("settings", {})))
    if files is not None:
        check_data(prep, files, Path(run_dir))
    prep.notes = _notes(prep, prep.stats_rows, None)
    return prep


def footer_digest(path: str) -> str:
    """sha256 of a Parquet file's footer (metadata + length + magic): it holds every
    row group's offsets, sizes and statistics, so a rewritten file changes it; reading
    it costs one seek, not a pass."""
    from data.files import open_input

    try:
        with open_input(path) as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(size - 8, 0))
            tail = fh.read(8)
            length = int.from_bytes(tail[:4], "little") if len(tail) == 8 else 0
            fh.seek(max(size - 8 - length, 0))
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as e:
        raise DataError(f"cannot be read ({e.strerror or one_line(e)})", file=path) from None


def footer_digests(files: list[str]) -> dict[str, str]:
    """file name → :func:`footer_digest` (names, so a moved data set still matches)."""
    from data.remote import file_name

    return {file_name(f): footer_digest(f) for f in files}


def check_data(prep: Preprocessing, files: list[str], where: Path) -> None:
    """One line if ``files`` are not the files ``prep`` was fitted over."""
    if not prep.data:
        return  # saved before fits recorded their data: nothing to check against
    now = footer_digests(files)
    for name in sorted(set(now) | set(prep.data)):
        if name not in prep.data:
            why = "is not among the files it was fitted over"
        elif name not in now:
            why = "was fitted over but is not in the data now"
        elif now[name] != prep.data[name]:
            why = "changed since the fit (Parquet footer sha256)"
        else:
            continue
        raise UserError(f"data.preprocessing={where}: data file {name} {why}; "
                        "fit again (dlrm fit) or drop data.preprocessing")


def digest(run_dir: Path) -> str | None:
    """sha256 of RUN/preprocessing.json (None if the run has none): what a checkpoint
    records so it refers to exactly its preprocessing."""
    path = Path(run_dir) / FILE
    return _sha256(path) if path.is_file() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()
