"""Streaming Parquet reader: row groups in, rank-sliced and shuffled mini-batches out.

The contract (other code and the tests rely on it)::

    files       a.parquet [a0:10][a1:10][a2:3]    b.parquet [b0:10]     (rows per row group)
    units       (a,0) (a,1) (a,2) (b,0)  -- permuted by RNG(seed, epoch) if shuffle,
                                            the same permutation on every rank
    stream      |  b0:10  |a2:3|  a0:10   |  a1:10   |                  N = 33 rows
    ranks (W=3) |rank 0: [0,11)|rank 1: [11,22)|rank 2: [22,33)|         [N*r//W, N*(r+1)//W)
    rank 1      reads b0 (last row), a2, a0 (first 7 rows): only the row groups it overlaps,
                one row group at a time, slicing the partial ones
    windows     its range cut in windows of S rows, S = max(b_r, shuffle_buffer // b_r * b_r);
                window k's rows permuted by RNG(seed, epoch, rank, k) if shuffle
    batches     local batch t = rows [t*b_r, (t+1)*b_r) of the (window-shuffled) range

* ``batch_size`` is global; rank r's share is b_r = batch_size // W + (r < batch_size % W).
* Every rank yields ``steps_per_epoch() = max over ranks of ceil(N_r / b_r)`` batches,
  computed from the footers alone. The last non-empty batch may be short; a rank whose
  rows ran out yields empty batches (B = 0: dense [0, n_dense], labels [0], a KJT with
  all keys, no values and no lengths, stride 0).
* Batch t is a pure function of (files, seed, epoch, rank, W, batch_size, t):
  ``epoch(e, start_step=k)`` seeks straight to window k*b_r // S and yields exactly the
  batches k.. of an uninterrupted epoch (resuming a checkpoint mid-epoch).
* A background thread decodes up to ``prefetch`` batches ahead (``prefetch=0``: decode
  in the caller's thread). Its exceptions re-raise in the consumer; abandoning the
  iterator (break, ``close()``, garbage) stops it.

Batch layout: see :mod:`data.batch`. Ids of a single-hot column give length 1 per
sample; a list column gives its list's length (a null list is an empty bag).

Decoding checks each row group and raises :class:`DataError` naming file, column, row
group and the row within the file: a null or out-of-[0, 1] label; a null, NaN or
infinite dense value (``dense_nan="zero"`` puts 0 there instead); a null or negative
id; an id >= its table's rows (``id_policy``: "error"; "modulo": id % rows; "hash":
splitmix64(id) % rows; only out-of-range ids are mapped, ids in range stay as they
are); a column whose type does not fit the schema.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from data.batch import Batch
from data.errors import DataError, UserError
from data.files import open_parquet
from data.schema import Schema, SparseFeature, allowed_kinds, check_files, column_kind, type_name

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

ID_POLICIES = ("error", "modulo", "hash")
DENSE_NAN_POLICIES = ("error", "zero")


class ParquetReader:
    """Mini-batches of one rank's share of a Parquet dataset; see the module docstring.

    ``num_rows`` counts the rows of all ranks together; ``local_batch_size`` is
    this rank's b_r. The constructor reads only footers (``check_files``), so a
    missing column or a wrong type fails before training starts.
    """

    def __init__(
        self,
        files: list[str],
        schema: Schema,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 65536,
        prefetch: int = 4,
        id_policy: str = "error",
        dense_nan: str = "error",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if id_policy not in ID_POLICIES or dense_nan not in DENSE_NAN_POLICIES:
            raise ValueError(f"id_policy {id_policy!r} / dense_nan {dense_nan!r} unknown")
        if batch_size < world_size:
            raise UserError(f"batch size {batch_size} is smaller than the {world_size} ranks")
        self.files, self.schema = list(files), schema
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.prefetch = shuffle, seed & (2**64 - 1), prefetch
        self.id_policy, self.dense_nan = id_policy, dense_nan
        check_files(self.files, schema)
        self._units = _units(self.files)
        self.num_rows = int(self._units.rows.sum())
        self.batch_size = batch_size
        self.local_batch_size = _share(batch_size, world_size, rank)
        self._lo, self._hi = _row_range(self.num_rows, world_size, rank)
        self._window = max(self.local_batch_size, shuffle_buffer // self.local_batch_size
                           * self.local_batch_size)
        self._steps = max(
            _local_steps(self.num_rows, batch_size, world_size, r) for r in range(world_size)
        )

    def steps_per_epoch(self) -> int:
        """Batches every rank yields per epoch (the same on all ranks)."""
        return self._steps

    def global_batch_size(self, step: int) -> int:
        """Rows of batch ``step`` summed over all ranks (known to every rank, no
        communication): the divisor of a global-mean loss when batches run short."""
        total = 0
        for r in range(self.world_size):
            lo, hi = _row_range(self.num_rows, self.world_size, r)
            b = _share(self.batch_size, self.world_size, r)
            total += max(0, min(b, hi - lo - step * b))
        return total

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """Batches ``start_step .. steps_per_epoch() - 1`` of epoch ``epoch``."""
        if not 0 <= start_step <= self._steps:
            raise ValueError(f"start_step {start_step} outside [0, {self._steps}]")
        if epoch < 0:
            raise ValueError(f"epoch {epoch} is negative")
        batches = self._batches(epoch, start_step)
        return _in_background(batches, self.prefetch) if self.prefetch > 0 else batches

    # ------------------------------------------------------------------ internals

    def _batches(self, epoch: int, start_step: int) -> Iterator[Batch]:
        order = np.arange(len(self._units.rows))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        starts = np.concatenate([[0], np.cumsum(self._units.rows[order])])
        source = _RowGroups(self.files, self.schema.columns)
        b, size = self.local_batch_size, self._hi - self._lo
        window, loaded = None, -1
        for t in range(start_step, self._steps):
            if t * b >= size:
                yield _Rows.empty(self.schema).batch(0, 0, self.schema)
                continue
            k = t * b // self._window
            if k != loaded:
                window, loaded = self._read_window(source, order, starts, epoch, k), k
            first = t * b - k * self._window
            yield window.batch(first, first + min(b, size - t * b), self.schema)

    def _read_window(
        self, source: _RowGroups, order: np.ndarray, starts: np.ndarray, epoch: int, k: int
    ) -> _Rows:
        """Rows [k*S, (k+1)*S) of this rank's range, decoded and (if shuffle) permuted."""
        r0 = self._lo + k * self._window
        r1 = min(r0 + self._window, self._hi)
        u = int(np.searchsorted(starts, r0, side="right")) - 1
        chunks = []
        while u < len(order) and starts[u] < r1:
            unit = int(order[u])
            s0, s1 = max(r0 - starts[u], 0), min(r1 - starts[u], self._units.rows[unit])
            f, g = int(self._units.file[unit]), int(self._units.row_group[unit])
            table = source.read(f, g).slice(s0, s1 - s0)
            where = _Where(self.files[f], g, int(self._units.row0[unit] + s0))
            chunks.append(_decode(table, self.schema, where, self.id_policy, self.dense_nan))
            u += 1
        rows = _Rows.concat(chunks)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, self.rank, k])
            rows = rows.take(rng.permutation(rows.size))
        return rows


# --------------------------------------------------------------------------- layout


def _share(total: int, world_size: int, rank: int) -> int:
    """Rank's part of ``total`` split as evenly as possible, larger parts first."""
    return total // world_size + (1 if rank < total % world_size else 0)


def _row_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous row range [N*r//W, N*(r+1)//W) of the stream."""
    return n * rank // world_size, n * (rank + 1) // world_size


def _local_steps(n: int, batch_size: int, world_size: int, rank: int) -> int:
    """ceil(N_r / b_r): the batches rank ``rank`` needs for its own rows."""
    lo, hi = _row_range(n, world_size, rank)
    return -(-(hi - lo) // _share(batch_size, world_size, rank))


@dataclass
class _Units:
    """The non-empty (file, row group) units in file order, with their sizes."""

    file: np.ndarray  # [U] index into files
    row_group: np.ndarray  # [U]
    rows: np.ndarray  # [U] rows in the row group
    row0: np.ndarray  # [U] index within its file of the row group's first row


def _units(files: list[str]) -> _Units:
    cols: list[list[int]] = [[], [], [], []]
    for f, path in enumerate(files):
        md = open_parquet(path).metadata
        row0 = 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if n:
                for c, v in zip(cols, (f, g, n, row0)):
                    c.append(v)
            row0 += n
    return _Units(*(np.asarray(c, dtype=np.int64) for c in cols))


class _RowGroups:
    """Reads one row group at a time, keeping the last one (it may straddle windows)."""

    def __init__(self, files: list[str], columns: list[str]) -> None:
        self.files, self.columns = files, columns
        self._open: tuple[int, pq.ParquetFile] | None = None
        self._last: tuple[int, int, pa.Table] | None = None

    def read(self, f: int, g: int) -> pa.Table:
        import pyarrow as pa

        if self._last is not None and self._last[:2] == (f, g):
            return self._last[2]
        if self._open is None or self._open[0] != f:
            self._open = (f, open_parquet(self.files[f]))
        try:
            table = self._open[1].read_row_group(g, columns=self.columns)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"cannot read ({str(e).strip()[:200]})", file=self.files[f],
                            row_group=g) from None
        self._last = (f, g, table)
        return table


# --------------------------------------------------------------------------- rows


@dataclass
class _Rows:
    """Decoded rows in numpy: labels [n], dense [n, n_dense], one id column per feature.

    ``ids[i]`` is (values, offsets): offsets [n + 1] for a bag column, None for a
    single-hot column (then values has exactly n entries).
    """

    labels: np.ndarray
    dense: np.ndarray
    ids: list[tuple[np.ndarray, np.ndarray | None]]

    @property
    def size(self) -> int:
        return len(self.labels)

    @staticmethod
    def empty(schema: Schema) -> _Rows:
        zero = np.zeros(1, dtype=np.int64)
        return _Rows(
            np.zeros(0, np.float32),
            np.zeros((0, len(schema.dense)), np.float32),
            [(np.zeros(0, np.int64), zero if f.multi_hot else None) for f in schema.sparse],
        )

    @staticmethod
    def concat(chunks: list[_Rows]) -> _Rows:
        if len(chunks) == 1:
            return chunks[0]
        ids = []
        for i, (_, offsets) in enumerate(chunks[0].ids):
            values = np.concatenate([c.ids[i][0] for c in chunks])
            if offsets is not None:
                lengths = np.concatenate([np.diff(c.ids[i][1]) for c in chunks])
                offsets = _offsets(lengths)
            ids.append((values, offsets))
        return _Rows(
            np.concatenate([c.labels for c in chunks]),
            np.concatenate([c.dense for c in chunks]),
            ids,
        )

    def take(self, perm: np.ndarray) -> _Rows:
        """Rows in the order ``perm`` [n] (bags gathered with vectorised index arithmetic)."""
        ids = []
        for values, offsets in self.ids:
            if offsets is None:
                ids.append((values[perm], None))
                continue
            lengths = np.diff(offsets)[perm]
            new = _offsets(lengths)
            shift = np.repeat(offsets[:-1][perm] - new[:-1], lengths)
            ids.append((values[np.arange(new[-1]) + shift], new))
        return _Rows(self.labels[perm], self.dense[perm], ids)

    def batch(self, a: int, b: int, schema: Schema) -> Batch:
        """Rows [a, b) as a Batch with a feature-major KeyedJaggedTensor."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        n = b - a
        values, lengths = [], []
        for vals, offsets in self.ids:
            if offsets is None:
                values.append(vals[a:b])
                lengths.append(np.ones(n, dtype=np.int64))
            else:
                values.append(vals[offsets[a] : offsets[b]])
                lengths.append(np.diff(offsets[a : b + 1]))
        empty = np.zeros(0, np.int64)
        kjt = KeyedJaggedTensor(
            keys=schema.sparse_names,
            values=torch.from_numpy(np.concatenate(values) if values else empty),
            lengths=torch.from_numpy(np.concatenate(lengths) if lengths else empty),
            stride=n,
        )
        return Batch(
            dense=torch.from_numpy(np.array(self.dense[a:b], dtype=np.float32)),
            sparse=kjt,
            labels=torch.from_numpy(np.array(self.labels[a:b], dtype=np.float32)),
        )


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


# --------------------------------------------------------------------------- decoding


@dataclass
class _Where:
    """Where a decoded slice comes from, for error messages."""

    file: str
    row_group: int
    row0: int  # index within the file of the slice's first row

    def error(self, message: str, column: str, index: int | None = None) -> DataError:
        row = None if index is None else self.row0 + int(index)
        return DataError(message, file=self.file, column=column, row_group=self.row_group, row=row)


def _decode(table: pa.Table, schema: Schema, where: _Where, id_policy: str,
            dense_nan: str) -> _Rows:
    """Check and convert one slice of a row group to numpy (no per-row Python)."""
    for name in schema.columns:
        t = table.schema.field(name).type
        if column_kind(t) not in allowed_kinds(schema, name):
            raise where.error(f"type {type_name(t)} does not fit the schema "
                              f"({' or '.join(allowed_kinds(schema, name))})", name)
    labels = _labels(table.column(schema.label), schema.label, where)
    dense = np.empty((table.num_rows, len(schema.dense)), dtype=np.float32)
    for j, name in enumerate(schema.dense):
        dense[:, j] = _dense(table.column(name), name, where, dense_nan)
    ids = [_ids(table.column(f.name), f, where, id_policy) for f in schema.sparse]
    return _Rows(labels, dense, ids)


def _first_null(col: pa.ChunkedArray | pa.Array) -> int:
    import pyarrow.compute as pc

    return int(pc.index(pc.is_null(col), True).as_py())


def _labels(col: pa.ChunkedArray, name: str, where: _Where) -> np.ndarray:
    if col.null_count:
        raise where.error("null label", name, _first_null(col))
    y = col.to_numpy().astype(np.float32, copy=False)
    bad = ~((y >= 0) & (y <= 1))
    if bad.any():
        i = int(np.argmax(bad))
        raise where.error(f"label {y[i]} outside [0, 1]", name, i)
    return y


def _dense(col: pa.ChunkedArray, name: str, where: _Where, policy: str) -> np.ndarray:
    import pyarrow.compute as pc

    if col.null_count:
        if policy == "error":
            raise where.error("null dense value (set data.dense_nan=zero to use 0)", name,
                              _first_null(col))
        col = pc.fill_null(col, 0)
    x = col.to_numpy().astype(np.float32, copy=False)
    bad = ~np.isfinite(x)
    if bad.any():
        if policy == "error":
            i = int(np.argmax(bad))
            raise where.error(f"dense value {x[i]} (set data.dense_nan=zero to use 0)", name, i)
        x = np.where(bad, np.float32(0), x)
    return x


def _ids(col: pa.ChunkedArray, feature: SparseFeature, where: _Where,
         policy: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Ids of one feature as (values, offsets or None), validated and policy-mapped."""
    import pyarrow.compute as pc

    name = feature.name
    if not feature.multi_hot:
        if col.null_count:
            raise where.error("null id", name, _first_null(col))
        values = col.to_numpy().astype(np.int64, copy=False)
        return _map_ids(values, feature, where, policy, None), None
    arr = col.combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
    offsets = _offsets(lengths)
    flat = arr.flatten()
    if flat.null_count:
        i = _first_null(flat)
        raise where.error("null id inside a bag", name, _row_of(offsets, i))
    values = flat.to_numpy().astype(np.int64, copy=False)
    return _map_ids(values, feature, where, policy, offsets), offsets


def _row_of(offsets: np.ndarray, value_index: int) -> int:
    return int(np.searchsorted(offsets, value_index, side="right")) - 1


def _map_ids(values: np.ndarray, feature: SparseFeature, where: _Where, policy: str,
             offsets: np.ndarray | None) -> np.ndarray:
    """Reject negative ids; map or reject ids >= the table's rows as ``policy`` says."""
    if values.size == 0:
        return values
    rows = feature.rows

    def row(i: int) -> int:
        return i if offsets is None else _row_of(offsets, i)

    if values.min() < 0:
        i = int(np.argmax(values < 0))
        raise where.error(f"negative id {values[i]}", feature.name, row(i))
    if values.max() < rows:
        return values
    big = values >= rows
    if policy == "error":
        i = int(np.argmax(big))
        raise where.error(
            f"id {values[i]} >= table rows {rows} (set data.rows, or data.id_policy=hash/modulo)",
            feature.name, row(i),
        )
    if policy == "modulo":
        return np.where(big, values % rows, values)
    out = values.copy()
    out[big] = (splitmix64(values[big]) % np.uint64(rows)).astype(np.int64)
    return out


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise: a fixed 64-bit mixing hash, uint64 [n] → [n]."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


# --------------------------------------------------------------------------- prefetch

T = TypeVar("T")
_ITEM, _DONE, _ERROR = range(3)


def _in_background(source: Generator[T, None, None], depth: int) -> Iterator[T]:
    """Run ``source`` in a daemon thread, at most ``depth`` items ahead of the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple[int, object]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def work() -> None:
        try:
            for item in source:
                if not put((_ITEM, item)):
                    return
            put((_DONE, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((_ERROR, e))
        finally:
            source.close()

    thread = threading.Thread(target=work, name="ParquetReader", daemon=True)
    thread.start()
    try:
        while True:
            try:
                kind, item = q.get(timeout=0.1)
            except queue.Empty:
                if not thread.is_alive() and q.empty():
                    raise RuntimeError("reader thread ended without a result") from None
                continue
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=10)
