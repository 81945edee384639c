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
                window k's rows permuted by RNG(seed, epoch, rank, k) if shuffle;
                shuffle_buffer="auto": 4 x the largest row group of the files, from
                their footers (data/shuffle_window.py), the same on every rank
    batches     local batch t = rows [t*b_r, (t+1)*b_r) of the (window-shuffled) range

* ``batch_size`` is global; rank r's share is b_r = batch_size // W + (r < batch_size % W).
* Every rank yields ``steps_per_epoch() = max over ranks of ceil(N_r / b_r)`` batches,
  computed from the footers alone. The last non-empty batch may be short; a rank whose
  rows ran out yields empty batches (B = 0: dense [0, n_dense], labels [0], JaggedFeatures with
  all keys, no values and no lengths, stride 0).
* Batch t is a pure function of (files, seed, epoch, rank, W, batch_size, t) and of
  shuffle_buffer (``auto``: of the files):
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
splitmix64(id) % rows; "drop": the id leaves its bag, which may become empty, and
``unseen_ids`` counts it per column for the last epoch read (held-out eval: ids the
trained table never saw); only out-of-range ids are mapped, ids in range stay as they
are); a column whose type does not fit the schema; a row group that cannot be read
(corrupt, its file gone).

``on_error="skip"`` drops instead (see :mod:`data.bad_data`): files whose footer is
unreadable or whose columns differ from the schema are left out of the layout at the
start; a bad value drops its row, an unreadable row group its rows, where the layout put
them: batch t is then batch t of the same layout minus the dropped rows, so steps, ranks
and resuming behave as above and batches come out shorter (possibly empty).
``bad_data`` holds the records of what was dropped, each added when the first batch of
the window it was found in is handed out.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from data import shm_batch, shuffle_window
from data.background import in_background
from data.bad_data import ON_ERROR, BadDataLog, BadRecord
from data.batch import Batch
from data.decode_workers import IN_FLIGHT, DecodePool, Transport
from data.errors import DataError, UserError, quoted
from data.files import open_parquet
from data.hashing import splitmix64
from data.rows import Alloc, Layout, Rows, WindowBuilder, batch_specs, offsets_of
from data.schema import Schema, SparseFeature, allowed_kinds, column_kind, screen_files, type_name
from data.shm_batch import Receiver, SlotRing, shm_free_bytes, slot_bytes, slots_that_fit

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.preprocess import Preprocessing

# CUDA with decode workers: the workers' batches are taken (queue, views of the slot) on
# a thread of the reader's own, two ahead. DLRM_TAKE_THREAD=0 (a developer's A/B, as
# DLRM_SHM_PIN) takes each on the consumer's thread instead, when it asks: one Python
# thread fewer beside a host-bound GPU step loop, for ~0.1 ms of its time a batch
# (scripts/gpu_session.sh runs both)
TAKE_THREAD = os.environ.get("DLRM_TAKE_THREAD", "1") != "0"

ID_POLICIES = ("error", "modulo", "hash", "drop")
DENSE_NAN_POLICIES = ("error", "zero")


class ParquetReader:
    """Mini-batches of one rank's share of a Parquet dataset; see the module docstring.

    ``num_rows`` counts the rows of all ranks together; ``local_batch_size`` is
    this rank's b_r. The constructor reads only footers (``screen_files``), so a
    missing column or a wrong type fails before training starts (or, with
    ``on_error="skip"``, leaves its file out; ``files`` are the files read).
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
        shuffle_buffer: int | str = "auto",
        prefetch: int = 4,
        id_policy: str = "error",
        dense_nan: str = "error",
        on_error: str = "fail",
        preprocess: Preprocessing | None = None,
        workers: int = 0,
        pin_memory: bool = False,
        worker_depth: int | None = None,
        shm_share: float = 1.0,
        fit_workers: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if (id_policy not in ID_POLICIES or dense_nan not in DENSE_NAN_POLICIES
                or on_error not in ON_ERROR):
            raise ValueError(f"id_policy {id_policy!r} / dense_nan {dense_nan!r} / "
                             f"on_error {on_error!r} unknown")
        if batch_size < world_size:
            raise UserError(f"batch size {batch_size} is smaller than the {world_size} ranks")
        self.schema = schema
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.prefetch = shuffle, seed & (2**64 - 1), prefetch
        self.id_policy, self.dense_nan, self.skip = id_policy, dense_nan, on_error == "skip"
        self.preprocess = preprocess  # vocabulary / hash features, dense transforms
        if workers < 0:
            raise ValueError(f"workers {workers} is negative")
        self.workers = workers  # decode processes (0: the background thread, or none)
        self._depth = worker_depth  # batches a worker decodes ahead (None: worker_depth())
        # the share of /dev/shm's free space this reader's workers may fill (torchrun: the
        # processes of a machine share it); fit_workers: fewer workers where it is short
        # (data.workers=auto), else a short /dev/shm is an error before they start
        self.shm_share, self.fit_workers = shm_share, fit_workers
        # batches handed out page-locked (CUDA training), pinned off the consumer's thread
        self.pin_memory = pin_memory
        self._pool: DecodePool | None = None  # the decode workers, from the first epoch on
        self.unseen_ids: dict[str, int] = {}  # id_policy="drop": ids dropped, by column
        self.layout = reader_layout(schema, id_policy, preprocess)
        screened = screen_files(list(files), schema, on_error)
        self.files = screened.files
        self.bad_data = BadDataLog(screened.left_out)
        self._units = _units(screened.row_groups)
        self.num_rows = int(self._units.rows.sum())
        self.batch_size = batch_size
        self.local_batch_size = _share(batch_size, world_size, rank)
        self._lo, self._hi = _row_range(self.num_rows, world_size, rank)
        # rows of a shuffle window as asked ("auto": from the footers); window_rows: as cut
        self.shuffle_buffer = shuffle_window.resolve(shuffle_buffer, screened.row_groups, schema)
        self._window = max(self.local_batch_size, self.shuffle_buffer // self.local_batch_size
                           * self.local_batch_size)
        self._steps = max(
            _local_steps(self.num_rows, batch_size, world_size, r) for r in range(world_size)
        )

    @property
    def window_rows(self) -> int:
        """S: the rows of this rank's shuffle windows (shuffle_buffer in whole batches)."""
        return self._window

    def steps_per_epoch(self) -> int:
        """Batches every rank yields per epoch (the same on all ranks)."""
        return self._steps

    def empty_batch(self) -> Batch:
        """A batch of no rows in this reader's layout (what a rank whose rows ran out yields)."""
        return Rows.empty(self.layout).batch(0, 0)

    def global_batch_size(self, step: int) -> int:
        """Rows of batch ``step`` summed over all ranks (known to every rank, no
        communication): the divisor of a global-mean loss when batches run short.
        With ``on_error="skip"`` this is before dropping: the real count needs the
        ranks' batch sizes summed."""
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
        self.unseen_ids = {}
        if self.workers > 0 and self._pool is None:
            self._fit_shared_memory()
        if self.workers > 0:
            if self.pin_memory and torch.cuda.is_available():  # this (the trainer's) thread's device
                shm_batch.register_for(torch.cuda.current_device())
            if self._pool is None:  # started once, kept across epochs
                self._pool = DecodePool(self.workers, self.worker_depth(), _SHARED)
                weakref.finalize(self, self._pool.close)
            windows = _Windows(self, epoch, start_step, unseen=True)
            batches = self._counted(self._pool.epoch(
                functools.partial(_Windows, self), (epoch, start_step, True), windows.numbers(),
                windows.empties()))
            if self.pin_memory:  # a thread of its own: the workers' batches arrive here
                batches = _pinned(batches)
                if TAKE_THREAD:
                    batches = in_background(batches, 2)
        else:
            batches = self._batches(epoch, start_step)
            if self.pin_memory:  # in the decoding thread, after each batch is assembled
                batches = _pinned(batches)
            if self.prefetch > 0:
                batches = in_background(batches, self.prefetch)
        return self._logged(batches)

    def worker_depth(self) -> int:
        """Batches each decode worker may hold decoded ahead of the trainer: a whole
        window's, at least ``prefetch``, as many as half of this reader's share of
        /dev/shm's free space holds over all workers (``worker_depth=`` given: that).

        The trainer takes a window's batches from one worker in a row
        (data/decode_workers.py). A worker a few batches ahead assembles the rest of its
        window while the trainer waits on it, so at 16 workers the trainer drained one
        worker at a time: the H200 host's 16 workers gave 4.81x one core's rate at 4 ahead
        (2026-11-27). A window ahead, each worker's next window is ready when the trainer
        comes to it."""
        if self._depth is not None:
            return max(1, self._depth)
        least = max(self.prefetch, 2)
        window = -(-min(self._window, self._hi - self._lo) // self.local_batch_size)
        room = slots_that_fit(self.workers, self._slot_bytes(), 0.5 * self.shm_share) - _HELD_BATCHES - IN_FLIGHT
        return max(least, min(window, room, _MAX_DEPTH))

    def _slot_bytes(self) -> int:
        """A worker's slot for one of this reader's batches, each feature one id a row
        (bags of more grow their slots)."""
        b, features = self.local_batch_size, len(self.layout.packed)
        return slot_bytes(batch_specs(b, self.layout.n_dense, b * features, features))

    def _fit_shared_memory(self) -> None:
        """Before the workers start: their slots, every one in use at once, within this
        reader's share of /dev/shm's free space. A slot written past the space is a
        SIGBUS in its worker, mid-run (Docker's default /dev/shm is 64 MB); so where they
        do not fit, fewer workers (``fit_workers``) or one line naming the space."""
        free = shm_free_bytes()
        if free is None:
            return
        room = int(free * self.shm_share)
        each = (self.worker_depth() + _HELD_BATCHES + IN_FLIGHT) * self._slot_bytes()
        if self.workers * each <= room:
            return
        fit = room // each
        if self.fit_workers:
            self.workers = fit
            return
        mib = 1 << 20
        raise UserError(
            f"data.workers={self.workers}: their batches need about {self.workers * each // mib:,} MiB of "
            f"shared memory (/dev/shm), {room // mib:,} MiB free for this process; give /dev/shm more room "
            f"(docker run --shm-size=...) or set data.workers={fit} or lower (0: no worker processes)")

    def worker_pids(self) -> list[int]:
        """Process ids of the decode workers (``workers`` > 0, from the first epoch on)."""
        return self._pool.pids() if self._pool is not None else []

    def close(self) -> None:
        """Stop the decode workers (also done when the reader is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()

    def __getstate__(self) -> dict:
        """Pickled into decode workers: the log of dropped rows and the workers
        themselves stay with the parent."""
        state = dict(self.__dict__)
        state["bad_data"], state["_pool"] = None, None
        return state

    # ------------------------------------------------------------------ internals

    def _counted(self, items: Iterator[tuple[Batch, list[BadRecord], dict[str, int]]]
                 ) -> Generator[tuple[Batch, list[BadRecord]], None, None]:
        """Decode workers' items: the ids each window dropped (id_policy="drop") added to
        ``unseen_ids`` here, where the one-thread reader counts them itself."""
        try:
            for batch, found, unseen in items:
                for name, n in unseen.items():
                    self.unseen_ids[name] = self.unseen_ids.get(name, 0) + n
                yield batch, found
        finally:
            items.close()

    def _logged(self, items: Iterator[tuple[Batch, list[BadRecord]]]) -> Iterator[Batch]:
        """The batches of ``items``; the records beside them go to ``bad_data`` as each
        batch is handed out (in the consumer's thread)."""
        try:
            for batch, found in items:
                if found:
                    self.bad_data.add(found)
                yield batch
        finally:
            items.close()

    def _batches(self, epoch: int, start_step: int
                 ) -> Generator[tuple[Batch, list[BadRecord]], None, None]:
        """(batch, records found in its window if it is the window's first batch)."""
        windows = _Windows(self, epoch, start_step)
        for k in windows.numbers():
            yield from windows(k)
        yield from windows.empties()

    def _read_window(
        self, source: _RowGroups, order: np.ndarray, starts: np.ndarray, epoch: int, k: int
    ) -> tuple[Rows, list[BadRecord]]:
        """Rows [k*S, (k+1)*S) of this rank's range, decoded into ``source``'s window
        buffer and (if shuffle) permuted, and the records of what was dropped from them
        (``on_error="skip"``)."""
        r0 = self._lo + k * self._window
        r1 = min(r0 + self._window, self._hi)
        u = int(np.searchsorted(starts, r0, side="right")) - 1
        out = source.window
        out.start(r1 - r0)
        found: list[BadRecord] = []
        while u < len(order) and starts[u] < r1:
            unit = int(order[u])
            s0, s1 = max(r0 - starts[u], 0), min(r1 - starts[u], self._units.rows[unit])
            f, g = int(self._units.file[unit]), int(self._units.row_group[unit])
            where = _Where(self.files[f], g, int(self._units.row0[unit] + s0))
            at = int(starts[u] + s0 - r0)
            try:
                table = source.read(f, g, int(self._units.rows[unit])).slice(s0, s1 - s0)
                _decode(table, self.schema, where, self.id_policy, self.dense_nan, (out, at),
                        found if self.skip else None, self.preprocess, self.unseen_ids)
            except DataError as e:
                if not self.skip:
                    raise
                out.dropped(at, s1 - s0)
                found.append(where.record(e.reason, e.column, 0, rows=s1 - s0))
            u += 1
        rows = out.finish()
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, self.rank, k])
            rows = rows.ordered(rng.permutation(rows.size))
        return rows, found


def _pinned(items: Generator[tuple[Batch, list[BadRecord]], None, None]
            ) -> Generator[tuple[Batch, list[BadRecord]], None, None]:
    """Each batch copied into page-locked memory (its H2D copy is then queued DMA),
    off the trainer's thread: a Hotline step and a graph-replayed step are bound by
    that thread's time (the 2026-11-26 H200 profile, 153cd2f: a Hotline step's GPU work
    3.1 ms of 8.6). With decode workers the shared-memory slot's copy is this pin (a
    pinned copy, data/shm_batch.py), taken here too; ``pin_memory()`` of a pinned
    batch is the batch itself."""
    try:
        for batch, found in items:
            yield batch.pin_memory(), found
    finally:
        items.close()


class _Windows:
    """The batches of one epoch of ``reader`` from ``start_step`` on, window by window:
    ``self(k)`` yields window k's (batch, records) in order, records on its first batch.
    Windows are independent, so decode workers (data/decode_workers.py) each take
    some; this object is pickled to them and reads its row groups where it runs."""

    def __init__(self, reader: ParquetReader, epoch: int, start_step: int,
                 unseen: bool = False, alloc: Alloc | None = None) -> None:
        self.reader, self.epoch, self.start_step = reader, epoch, start_step
        self.unseen = unseen  # items carry the window's dropped-id counts (in a worker)
        self.alloc = alloc  # where batches are written (a worker's shared memory)
        order = np.arange(len(reader._units.rows))
        if reader.shuffle:
            order = np.random.default_rng([reader.seed, epoch]).permutation(order)
        self.order = order
        self.starts = np.concatenate([[0], np.cumsum(reader._units.rows[order])])
        self._source: _RowGroups | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_source": None, "alloc": None}

    def _span(self) -> tuple[int, int]:
        """[first, end) steps holding rows: batches t >= end are empty."""
        r = self.reader
        return self.start_step, max(self.start_step, -(-(r._hi - r._lo) // r.local_batch_size))

    def numbers(self) -> list[int]:
        """The windows holding batches start_step.., in order."""
        first, end = self._span()
        if first >= end:
            return []
        b, s = self.reader.local_batch_size, self.reader._window
        return list(range(first * b // s, (end - 1) * b // s + 1))

    def __call__(self, k: int) -> Generator[tuple, None, None]:
        r = self.reader
        if self._source is None:
            self._source = _RowGroups(r.files, r.schema.columns, WindowBuilder(r.layout),
                                      [f.name for f in r.schema.sparse
                                       if f.encoding != "identity" and not f.multi_hot])
        if not self.unseen:  # the reader's own thread: it counts into unseen_ids itself
            window, found = r._read_window(self._source, self.order, self.starts, self.epoch, k)
            yield from self._batches_of(window, found, k)
            return
        r.unseen_ids = {}  # a worker's copy of the reader: this window's counts, sent along
        window, found = r._read_window(self._source, self.order, self.starts, self.epoch, k)
        for item in self._batches_of(window, found, k):
            yield (*item, r.unseen_ids)
            r.unseen_ids = {}

    def _batches_of(self, window: Rows, found: list[BadRecord], k: int
                    ) -> Generator[tuple[Batch, list[BadRecord]], None, None]:
        r = self.reader
        b, size = r.local_batch_size, r._hi - r._lo
        first, end = self._span()
        per = r._window // b
        for t in range(max(first, k * per), min(end, (k + 1) * per)):
            a = t * b - k * r._window
            yield window.batch(a, a + min(b, size - t * b), self.alloc), found
            found = []

    def empties(self) -> Iterator[tuple[Batch, list[BadRecord]]]:
        """The empty batches after this rank's rows ran out."""
        first, end = self._span()
        for _ in range(max(end, first), self.reader._steps):
            item = (Rows.empty(self.reader.layout).batch(0, 0), [])
            yield (*item, {}) if self.unseen else item


class _WorkerSlots(SlotRing):
    """In a decode worker: items (batch, records, unseen ids) → (handle, records, ...)."""

    def pack(self, item: tuple) -> tuple:  # type: ignore[override]
        return (super().pack(item[0]), *item[1:])

    def unsent(self, message: tuple) -> None:
        self.free(message[0])


class _TrainerSlots(Receiver):
    """In the trainer: (handle, records, unseen ids) → (batch viewing its slot, ...);
    with CUDA a pinned copy (the H2D copy is then async)."""

    def __init__(self, state: object) -> None:
        super().__init__(state, _HELD_BATCHES, pin=torch.cuda.is_available())

    def unpack(self, message: tuple) -> tuple:
        return (self.take(message[0]), *message[1:])

    def discard(self, message: tuple) -> None:
        self.free(message[0])


# batches a worker decodes ahead at most: a slot is a /dev/shm block the trainer keeps
# mapped (data/shm_batch.py). Past it (windows of more, small batches) a worker is this
# many into its next window when the trainer comes to it.
_MAX_DEPTH = 128
# the trainer holds the batch of the step, the next one (Hotline's split ahead, the
# prefetcher's), the pinning thread's two queued (CUDA) and those whose H2D copy from
# their registered slot is in flight (data/pinned.py), mostly of one worker (a window's
# batches come from one in a row); beyond this many per worker, batches are copied out
# of the slots
_HELD_BATCHES = 8
_SHARED = Transport(_WorkerSlots, _TrainerSlots, _HELD_BATCHES)  # decode workers' batches


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


def _units(row_groups: list[list[int]]) -> _Units:
    """Units from the rows of each row group of each file (``Screened.row_groups``)."""
    cols: list[list[int]] = [[], [], [], []]
    for f, sizes in enumerate(row_groups):
        row0 = 0
        for g, n in enumerate(sizes):
            if n:
                for c, v in zip(cols, (f, g, n, row0)):
                    c.append(v)
            row0 += n
    return _Units(*(np.asarray(c, dtype=np.int64) for c in cols))


class _RowGroups:
    """Reads one row group at a time, keeping the last one (it may straddle windows)."""

    def __init__(self, files: list[str], columns: list[str], window: WindowBuilder,
                 dictionary: list[str]) -> None:
        self.files, self.columns = files, columns
        self.window = window  # the buffer windows are decoded into
        # string columns of vocabulary/hash features, read dictionary-encoded: their
        # distinct values are mapped once per row group (data/preprocess.py)
        self.dictionary = dictionary
        self._open: tuple[int, pq.ParquetFile] | None = None
        self._last: tuple[int, int, pa.Table] | None = None

    def read(self, f: int, g: int, rows: int) -> pa.Table:
        """Row group g of file f, which the footers said holds ``rows`` rows; a
        DataError naming both if it cannot be read (corrupt, file gone or changed)."""
        import pyarrow as pa

        if self._last is not None and self._last[:2] == (f, g):
            return self._last[2]
        path = self.files[f]
        try:
            if self._open is None or self._open[0] != f:
                self._open = None
                self._open = (f, open_parquet(path, self.dictionary))
            table = self._open[1].read_row_group(g, columns=self.columns)
        except DataError as e:
            raise DataError(e.reason, file=path, row_group=g) from None
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"cannot read ({quoted(e)})", file=path, row_group=g) from None
        if table.num_rows != rows:
            raise DataError(f"holds {table.num_rows} rows, {rows} when the run started "
                            "(file changed while reading?)", file=path, row_group=g)
        self._last = (f, g, table)
        return table


# --------------------------------------------------------------------------- rows


# --------------------------------------------------------------------------- decoding


@dataclass
class _Where:
    """Where a decoded slice comes from, for error messages and records."""

    file: str | None  # None: rows held in memory (decode_table)
    row_group: int | None
    row0: int  # index within the file of the slice's first row

    def error(self, message: str, column: str, index: int | None = None) -> DataError:
        row = None if index is None else self.row0 + int(index)
        return DataError(message, file=self.file, column=column, row_group=self.row_group, row=row)

    def record(self, reason: str, column: str | None, index: int, rows: int = 1) -> BadRecord:
        return BadRecord(self.file, reason, self.row_group, column, self.row0 + int(index), rows)


class _Problems:
    """Bad values of one slice: the first raises (``found`` None: on_error="fail"), or
    each is recorded in ``found`` and its row dropped from ``keep`` [n] ("skip")."""

    def __init__(self, where: _Where, n: int, found: list[BadRecord] | None) -> None:
        self.where, self.found = where, found
        self.keep = np.ones(n, dtype=bool)

    def flag(self, bad: np.ndarray, column: str, reason: Callable[[int], str]) -> None:
        """``bad`` [n] marks the rows whose value in ``column`` is bad; reason(i) says why."""
        if not bad.any():
            return
        if self.found is None:
            i = int(np.argmax(bad))
            raise self.where.error(reason(i), column, i)
        for i in np.flatnonzero(bad).tolist():
            self.found.append(self.where.record(reason(i), column, i))
        self.keep &= ~bad


def _mapped(prep: Preprocessing | None, f: SparseFeature, table: pa.Table,
            where: _Where) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of a vocabulary or hash feature's column; a DataError of the mapping (an int
    column against a vocabulary of strings: eval data written another way) names the
    file and row group, which the mapping does not know."""
    try:
        return _prep(prep, f).ids(f, table.column(f.name))
    except DataError as e:
        if e.file is not None:
            raise
        raise where.error(e.reason, f.name) from None


def _decode(table: pa.Table, schema: Schema, where: _Where, id_policy: str,
            dense_nan: str, into: tuple[WindowBuilder, int], found: list[BadRecord] | None = None,
            prep: Preprocessing | None = None, unseen: dict[str, int] | None = None) -> None:
    """Check and convert one slice of a row group straight into its rows [at, at + n)
    of the window ``into`` = (window, at) (no per-row Python, except once per bad value
    when ``found`` collects them). A column missing or of a type that does not fit is a
    DataError for the whole slice. ``prep`` maps vocabulary and hash features and
    transforms dense columns (data/preprocess.py)."""
    for name in schema.columns:
        if table.schema.get_field_index(name) < 0:
            raise where.error("column is missing (file changed while reading?)", name)
        t = table.schema.field(name).type
        if column_kind(t) not in allowed_kinds(schema, name):
            raise where.error(f"type {type_name(t)} does not fit the schema "
                              f"({' or '.join(allowed_kinds(schema, name))})", name)
    out, at = into
    n, layout = table.num_rows, out.layout
    problems = _Problems(where, n, found)
    labels = _labels(table.column(schema.label), schema.label, problems)
    dense = []
    for name in schema.dense:
        x = _dense(table.column(name), name, problems, dense_nan)
        dense.append(prep.dense(name, x) if prep is not None else x)
    ids, bags = [], []
    for j, f in enumerate(schema.sparse):
        values, offsets = (_ids(table.column(f.name), f, problems, id_policy, unseen)
                           if f.encoding == "identity" else _mapped(prep, f, table, where))
        if layout.packed[j]:
            ids.append(values)  # in slot order: packed features take slots in schema order
        else:  # added once the whole slice decoded: a DataError leaves no bag behind
            bags.append((j, values, np.arange(n + 1) if offsets is None else offsets))
    out.write(at, [*ids, *dense, labels])
    for j, values, offsets in bags:
        out.bag(j, values, offsets)
    if not problems.keep.all():
        out.drop(at, problems.keep)


def decode_table(table: pa.Table, schema: Schema, *, id_policy: str = "error",
                 dense_nan: str = "error", preprocess: Preprocessing | None = None,
                 row0: int = 0, unseen: dict[str, int] | None = None) -> Batch:
    """All rows of ``table`` (a Parquet row group's worth held in memory: the schema's
    columns, as the files had them) as one Batch, decoded, checked and mapped exactly as
    the reader decodes a row group. A bad value is a DataError naming its column and
    its row, counted from ``row0``."""
    window = WindowBuilder(reader_layout(schema, id_policy, preprocess))
    window.start(table.num_rows)
    _decode(table, schema, _Where(None, None, row0), id_policy, dense_nan, (window, 0), None,
            preprocess, unseen)
    return window.finish().batch(0, table.num_rows)


def reader_layout(schema: Schema, id_policy: str, prep: Preprocessing | None = None) -> Layout:
    """Single-hot ids packed in each row's record; a feature that may leave a row with
    no id (a bag, an identity id under id_policy="drop") keeps its own offsets. A
    vocabulary or hash feature's ids are bounded by the mapping's rows (``prep``), an
    identity feature's by the schema's."""
    bounds = [max(f.rows, prep.rows.get(f.table_name, 0)) if prep is not None and f.encoding != "identity"
              else f.rows for f in schema.sparse]
    return Layout(schema, [not f.multi_hot and not (f.encoding == "identity" and id_policy == "drop")
                           for f in schema.sparse], bounds)


def _prep(prep: Preprocessing | None, feature: SparseFeature) -> Preprocessing:
    if prep is None:
        raise ValueError(f"feature {feature.name} ({feature.encoding}) needs the run's "
                         "preprocessing (ParquetReader(preprocess=...))")
    return prep


def _nulls(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    import pyarrow.compute as pc

    return np.asarray(pc.is_null(col).to_numpy(zero_copy_only=False), dtype=bool)


def _labels(col: pa.ChunkedArray, name: str, problems: _Problems) -> np.ndarray:
    import pyarrow.compute as pc

    if col.null_count:
        problems.flag(_nulls(col), name, lambda i: "null label")
        col = pc.fill_null(col, 0)
    y = col.to_numpy().astype(np.float32, copy=False)
    problems.flag(~((y >= 0) & (y <= 1)), name, lambda i: f"label {y[i]} outside [0, 1]")
    return y


def _dense(col: pa.ChunkedArray, name: str, problems: _Problems, policy: str) -> np.ndarray:
    import pyarrow.compute as pc

    hint = " (set data.dense_nan=zero to use 0)"
    if col.null_count:
        if policy == "error":
            problems.flag(_nulls(col), name, lambda i: "null dense value" + hint)
        col = pc.fill_null(col, 0)
    with np.errstate(over="ignore"):  # a float64 beyond float32: inf, flagged below
        x = col.to_numpy().astype(np.float32, copy=False)
    bad = ~np.isfinite(x)
    if bad.any():
        if policy == "error":
            problems.flag(bad, name, lambda i: f"dense value {x[i]}" + hint)
        else:
            x = np.where(bad, np.float32(0), x)
    return x


def _ids(col: pa.ChunkedArray, feature: SparseFeature, problems: _Problems,
         policy: str, unseen: dict[str, int] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Ids of one feature as (values, offsets or None), validated and policy-mapped."""
    import pyarrow.compute as pc

    name = feature.name
    if not feature.multi_hot:
        if col.null_count:
            hint = "" if problems.found is not None else _null_id_hint(name)
            problems.flag(_nulls(col), name, lambda i: "null id" + hint)
            col = pc.fill_null(col, 0)
        values = col.to_numpy().astype(np.int64, copy=False)
        return _map_ids(values, feature, problems, policy, None, unseen, _is_uint64(col.type))
    arr = col.combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
    offsets = offsets_of(lengths)
    flat = arr.flatten()
    if flat.null_count:
        problems.flag(_bag_rows(offsets, _nulls(flat)), name, lambda i: "null id inside a bag")
        flat = pc.fill_null(flat, 0)
    values = flat.to_numpy().astype(np.int64, copy=False)
    return _map_ids(values, feature, problems, policy, offsets, unseen, _is_uint64(flat.type))


def _is_uint64(t: pa.DataType) -> bool:
    """uint64 ids (a dictionary's values): those of 2^63 and up read as negative int64."""
    import pyarrow as pa

    return pa.types.is_uint64(t.value_type if pa.types.is_dictionary(t) else t)


def _null_id_hint(name: str) -> str:
    """The ways past a null identity id (pandas' nullable Int64 writes a missing id so)."""
    return (f": an identity id is its own row and a null names none; data.encodings={{{name}: "
            f"vocabulary}} (or hash) gives nulls row 0, data.on_error=skip drops their rows")


def _bag_rows(offsets: np.ndarray, bad_values: np.ndarray) -> np.ndarray:
    """Rows [n] holding at least one of the bag values marked in ``bad_values``."""
    rows = np.zeros(len(offsets) - 1, dtype=bool)
    rows[np.searchsorted(offsets, np.flatnonzero(bad_values), side="right") - 1] = True
    return rows


def _map_ids(values: np.ndarray, feature: SparseFeature, problems: _Problems, policy: str,
             offsets: np.ndarray | None, unseen: dict[str, int] | None = None,
             unsigned: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Reject negative ids; map, drop or reject ids >= the table's rows as ``policy``
    says. Returns (values, offsets): dropping gives a single-hot column offsets too.
    ``unsigned``: ``values`` are uint64 ids viewed as int64; they are compared, shown and
    mapped as the uint64 they are (those of 2^63 and up read negative as int64)."""
    if values.size == 0:
        return values, offsets
    rows = feature.rows
    keys = values.view(np.uint64) if unsigned else values
    limit = np.uint64(rows) if unsigned else rows

    def flag(bad: np.ndarray, what: Callable[[int], str]) -> None:
        """Flag the rows of the values marked in ``bad``, each by its first bad value."""
        def reason(i: int) -> str:
            lo, hi = (i, i + 1) if offsets is None else (offsets[i], offsets[i + 1])
            return what(int(keys[lo:hi][bad[lo:hi]][0]))

        problems.flag(bad if offsets is None else _bag_rows(offsets, bad), feature.name, reason)

    top = values.view(np.uint64).max()  # one pass: a negative int64 id reads as 2^63 or more here
    if top < np.uint64(rows):
        return values, offsets
    if not unsigned and top >= np.uint64(2**63):  # some id is negative
        flag(values < 0, lambda v: f"negative id {v}")
        if keys.max() < limit:
            return values, offsets
    big = keys >= limit
    if policy == "error":
        flag(big, lambda v: f"id {v} >= table rows {rows} (set data.rows, or "
                            "data.id_policy=hash/modulo)")
        return values, offsets
    if policy == "drop":
        return _drop(values, offsets, big, feature.name, unseen)
    if policy == "modulo":
        return np.where(big, keys % limit, keys).astype(np.int64, copy=False), offsets
    out = values.copy()
    out[big] = (splitmix64(keys[big]) % np.uint64(rows)).astype(np.int64)
    return out, offsets


def _drop(values: np.ndarray, offsets: np.ndarray | None, big: np.ndarray, name: str,
          unseen: dict[str, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """Take the ``big`` values out of their bags (counted in ``unseen[name]``)."""
    if unseen is not None:
        unseen[name] = unseen.get(name, 0) + int(big.sum())
    if offsets is None:
        offsets = np.arange(values.size + 1, dtype=np.int64)
    lengths = np.diff(offsets)
    bag = np.repeat(np.arange(lengths.size), lengths)
    lengths = lengths - np.bincount(bag[big], minlength=lengths.size)
    return values[~big], offsets_of(lengths)
