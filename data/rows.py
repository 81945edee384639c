"""A decoded window of rows, packed one record per row, and batches cut out of it.

    record of a row (Layout)   [ id f0 | id f1 | ... | id fP-1 | dense 0..D-1 | label | pad ]
                                 int32 per single-hot feature    float32 each   float32  to 8 bytes
                                 (int64 if a table has over 2^31 rows)
    bags (multi-hot features)  values [sum of lengths] and offsets [n + 1] beside, per feature

    window  rec [S, width] uint8  ──shuffle: one np.take of whole records per batch──►
    batch   rec [b, width]  ──split──►  ids [P, b] (one transposed copy) | dense [b, D] | labels [b]

The decoder writes each row group's columns straight into their places in the window's
records (one strided copy per column, no concatenation of row groups), and a shuffled
batch gathers its rows as whole records: one random read of a few cache lines per row,
where one array per column would cost a random read per column per row. A feature that
may leave a row with no id (a multi-hot bag, or an identity feature under
``id_policy="drop"``) keeps (values, offsets) instead, gathered by index arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from data.batch import Batch
from data.jagged import JaggedFeatures
from data.schema import Schema


class Layout:
    """Where each field of a row lies in its record; ``packed[j]``: feature j is a
    single-hot id in the record (else a bag). Packed features take slots in schema order."""

    def __init__(self, schema: Schema, packed: list[bool], rows: list[int] | None = None) -> None:
        """``rows``: each feature's table rows, the bound of its ids (default: the schema's)."""
        self.keys = list(schema.sparse_names)
        self.packed = packed
        self.slot = [int(sum(packed[:j])) if p else -1 for j, p in enumerate(packed)]
        self.n_ids, self.n_dense = int(sum(packed)), len(schema.dense)
        # A packed id is a row of its table (checked, or mapped there, before it is
        # written): int32 where no such table has over 2^31 rows. The record then
        # shrinks (26 ids, 13 dense: 160 bytes, not 264), and so do the shuffle's random
        # reads of whole records; a batch's ids are int64 all the same (_split widens them).
        bounds = rows if rows is not None else [f.rows for f in schema.sparse]
        narrow = all(n <= 2**31 for n, p in zip(bounds, packed) if p)
        self.id_dtype = np.dtype(np.int32 if narrow else np.int64)
        self.dense_at = self.id_dtype.itemsize * self.n_ids  # byte offsets in a record
        self.label_at = self.dense_at + 4 * self.n_dense
        self.width = -(-(self.label_at + 4) // 8) * 8  # whole 8 bytes: aligned ids in every row
        self.runs = _runs(packed)
        self.words = _words(self.n_ids, self.n_dense, self.id_dtype.itemsize)

    def ids(self, rec: np.ndarray) -> np.ndarray:
        """[n, P] view of the packed ids (``id_dtype``) of records ``rec`` [n, width]."""
        return rec[:, : self.dense_at].view(self.id_dtype)

    def dense(self, rec: np.ndarray) -> np.ndarray:
        """[n, D] float32 view."""
        return rec[:, self.dense_at : self.label_at].view(np.float32)

    def labels(self, rec: np.ndarray) -> np.ndarray:
        """[n] float32 view."""
        return rec[:, self.label_at : self.label_at + 4].view(np.float32)[:, 0]


def _words(n_ids: int, n_dense: int, id_bytes: int) -> list[tuple[int, int, int | None]]:
    """(word, field, field or None) for each 8-byte word of a record: the fields it
    holds, low half first. Fields in record order: the packed ids, the dense values,
    the label; a word of an int64 id holds that field alone, as does the last word when
    the fields end half-way through it (the rest is padding)."""
    sizes = [id_bytes] * n_ids + [4] * (n_dense + 1)
    words: list[tuple[int, int, int | None]] = []
    at = 0
    for i, size in enumerate(sizes):
        if at % 8:  # the high half of the word the previous field began
            words[-1] = (words[-1][0], words[-1][1], i)
        else:
            words.append((at // 8, i, None))
        at += size
    return words


def _runs(packed: list[bool]) -> list[tuple[bool, int, int]]:
    """(packed?, first feature, end feature) of each run of alike features, in order."""
    runs: list[tuple[bool, int, int]] = []
    for j, p in enumerate(packed):
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1], j + 1)
        else:
            runs.append((p, j, j + 1))
    return runs


@dataclass
class Rows:
    """n decoded rows: ``rec`` [n, width] records, ``bags`` {feature: (values, offsets
    [n + 1])} for the features not packed. ``keep`` [n] marks the rows a batch takes
    (None: all); dropped rows keep their place until then. ``order`` [n] (None: stored
    order) is the window's shuffle, applied per batch."""

    layout: Layout
    rec: np.ndarray
    bags: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    keep: np.ndarray | None = None
    order: np.ndarray | None = None  # row i of the rows is stored row order[i] (lazy shuffle)
    scratch: Scratch = field(default_factory=lambda: Scratch())  # a shuffled batch's records

    @property
    def size(self) -> int:
        return len(self.rec)

    @staticmethod
    def empty(layout: Layout) -> Rows:
        zero = np.zeros(1, dtype=np.int64)
        return Rows(layout, np.zeros((0, layout.width), np.uint8),
                    {j: (np.zeros(0, np.int64), zero) for j, p in enumerate(layout.packed) if not p})

    def ordered(self, perm: np.ndarray) -> Rows:
        """The rows in the order ``perm`` [n], applied lazily: ``batch`` gathers each
        batch's records straight out of the window (one copy per batch)."""
        order = perm if self.order is None else self.order[perm]
        return Rows(self.layout, self.rec, self.bags, self.keep, order, self.scratch)

    def batch(self, a: int, b: int, alloc: Alloc | None = None) -> Batch:
        """Rows [a, b) (of ``order`` if set) as a Batch with feature-major
        JaggedFeatures, kept rows only, its arrays from ``alloc`` (default: fresh ones)."""
        idx = None if self.order is None else self.order[a:b]
        if self.keep is not None:
            kept = self.keep[a:b] if idx is None else self.keep[idx]
            if not kept.all():
                idx = (np.arange(a, b) if idx is None else idx)[kept]
        if idx is None:
            rec, bags = self.rec[a:b], {j: _slice_bag(v, o, a, b) for j, (v, o) in self.bags.items()}
        else:
            rec = self.scratch.records(len(idx), self.layout.width)
            records = np.dtype((np.void, self.layout.width))  # one whole record per index
            np.take(self.rec.view(records)[:, 0], idx, out=rec.view(records)[:, 0], mode="clip")
            bags = {j: _gather_bag(v, o, idx) for j, (v, o) in self.bags.items()}
        return _split(self.layout, rec, bags, alloc or fresh_arrays)


Alloc = Callable[[list[tuple[tuple[int, ...], np.dtype]]], list[np.ndarray]]
"""Makes empty arrays of the given (shape, dtype)s: where a batch is written (a decode
worker passes one that carves them out of shared memory: data/shm_batch.py)."""


def fresh_arrays(specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    return [np.empty(shape, dtype) for shape, dtype in specs]


def batch_specs(n: int, n_dense: int, n_values: int, n_features: int
                ) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of a batch's dense, labels, values and lengths, in that order."""
    f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
    return [((n, n_dense), f32), ((n,), f32), ((n_values,), i64), ((n_features * n,), i64)]


class Scratch:
    """Where a shuffled batch's records are gathered before they are split into its
    tensors (which copy them): one buffer reused batch after batch. A fresh one per batch
    costs its page faults again wherever malloc hands the memory back to the system
    (in a decode worker it doubled the gather's time)."""

    def __init__(self) -> None:
        self.buffer = np.zeros((0, 0), np.uint8)

    def records(self, n: int, width: int) -> np.ndarray:
        """[n, width] uint8, overwritten by the next call."""
        if self.buffer.shape[0] < n or self.buffer.shape[1] != width:
            self.buffer = np.empty((n, width), np.uint8)
        return self.buffer[:n]


def _split(layout: Layout, rec: np.ndarray, bags: dict[int, tuple[np.ndarray, np.ndarray]],
           alloc: Alloc) -> Batch:
    """A batch out of its records [n, width] and its bags {feature: (values, lengths [n])},
    written into arrays from ``alloc``."""
    n, ids = len(rec), layout.ids(rec)
    sizes = [n if p else len(bags[j][0]) for j, p in enumerate(layout.packed)]
    dense, labels, values, lengths = alloc(batch_specs(n, layout.n_dense, sum(sizes), len(sizes)))
    # copies (C order): the window's buffer is reused for the next window
    dense[:] = layout.dense(rec)
    labels[:] = layout.labels(rec)
    lengths.fill(1)
    at = 0
    for packed, j0, j1 in layout.runs:
        if packed:  # consecutive packed features: one transposed copy
            s0 = layout.slot[j0]
            values[at : at + (j1 - j0) * n].reshape(j1 - j0, n)[:] = ids[:, s0 : s0 + j1 - j0].T
            at += (j1 - j0) * n
            continue
        for j in range(j0, j1):
            values[at : at + sizes[j]] = bags[j][0]
            lengths[j * n : (j + 1) * n] = bags[j][1]
            at += sizes[j]
    sparse = JaggedFeatures(keys=layout.keys, values=torch.from_numpy(values),
                            lengths=torch.from_numpy(lengths), stride=n)
    return Batch(dense=torch.from_numpy(dense), sparse=sparse, labels=torch.from_numpy(labels))


def _slice_bag(values: np.ndarray, offsets: np.ndarray, a: int, b: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of bags [a, b)."""
    return values[offsets[a] : offsets[b]], np.diff(offsets[a : b + 1])


def _gather_bag(values: np.ndarray, offsets: np.ndarray, idx: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of bags ``idx``, by vectorised index arithmetic."""
    lengths = np.diff(offsets)[idx]
    size = int(lengths.sum())
    out = np.empty(size, np.int64)
    if size:
        shift = np.repeat(offsets[:-1][idx] - offsets_of(lengths)[:-1], lengths)
        np.take(values, np.arange(size) + shift, out=out, mode="clip")  # clip: unbuffered
    return out, lengths


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """Offsets [n + 1] of bags of ``lengths`` [n]."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


_SHIFT = np.uint64(32)  # a word's high half


class WindowBuilder:
    """Rows of one window, decoded chunk by chunk into one record buffer (reused from
    window to window: a fresh one would page-fault all over again)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._buffer = np.zeros((0, layout.width), np.uint8)
        self.scratch = Scratch()  # reused by the batches of every window
        # write's two words of each row (16 bytes a row of the largest slice; the slice's
        # own columns take 264 for the bench schema), reused: fresh ones would page-fault
        self._low = self._high = np.zeros(0, np.uint64)

    def start(self, n: int) -> None:
        """A window of ``n`` rows: chunks follow with ``at`` from 0 up to n."""
        if len(self._buffer) < n:
            self._buffer = np.empty((n, self.layout.width), np.uint8)
        self.rec = self._buffer[:n]
        self.keep: np.ndarray | None = None
        self.bags: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {
            j: [] for j, p in enumerate(self.layout.packed) if not p}

    def drop(self, at: int, keep: np.ndarray) -> None:
        """Of rows [at, at + len(keep)), those not in ``keep`` take no batch."""
        if self.keep is None:
            self.keep = np.ones(len(self.rec), bool)
        self.keep[at : at + len(keep)] &= keep

    def dropped(self, at: int, n: int) -> None:
        """Rows [at, at + n) could not be read: none taken, empty bags in their place."""
        self.drop(at, np.zeros(n, bool))
        for j in self.bags:
            self.bag(j, np.zeros(0, np.int64), np.zeros(n + 1, np.int64))

    def write(self, at: int, fields: list[np.ndarray]) -> None:
        """Rows [at, at + n) of every record field, from ``fields`` [n] each in record
        order (``Layout.words``): the packed ids (int64), the dense values and the labels
        (float32).

        One strided copy per 8-byte word of the record, not one per field: two 4-byte
        fields are first put side by side in one uint64 array (a shift and an or over
        contiguous arrays). The strided copies are what costs: each touches every
        record's cache line, and one that also casts (int64 to an int32 field) runs
        through numpy's buffered loop. Per field, block by block, the bench schema's
        40 fields took 88-98 ns a row to decode; as 20 words, 68-81 (this 2-core
        machine, a 64k-row group, 5 rounds each).

        An id in the low half of a word is not masked to 32 bits: every id the
        decoder keeps fits its int32 field (checked, or mapped into its table), and
        one that does not is in a row it drops (``on_error=skip``) or raises on; its
        high bits can reach only that same row's next field."""
        n = len(fields[0]) if fields else 0
        if len(self._low) < n:
            self._low, self._high = np.empty(n, np.uint64), np.empty(n, np.uint64)
        low, high = self._low[:n], self._high[:n]
        words = self.rec[at : at + n].view(np.uint64)
        for k, first, second in self.layout.words:
            x = self._bits(first, fields[first])
            if x.dtype == np.uint32:  # a float's bits, widened
                np.copyto(low, x)
                x = low
            if second is not None:
                np.left_shift(self._bits(second, fields[second]), _SHIFT, out=high)
                x = np.bitwise_or(x, high, out=low)
            words[:, k] = x  # a lone field (an int64 id, or the label before padding): all its word

    def _bits(self, i: int, x: np.ndarray) -> np.ndarray:
        """Field i's values as bits: an id's int64 as uint64, a dense value's or the
        label's float32 as uint32 (by the field's place, whatever dtype it came in)."""
        if i < self.layout.n_ids:
            return np.asarray(x, np.int64).view(np.uint64)
        return np.asarray(x, np.float32).view(np.uint32)

    def bag(self, j: int, values: np.ndarray, offsets: np.ndarray) -> None:
        """The next chunk of bag feature j (chunks come in row order)."""
        self.bags[j].append((values, offsets))

    def finish(self) -> Rows:
        bags = {}
        for j, chunks in self.bags.items():
            if len(chunks) == 1:
                bags[j] = chunks[0]
            else:
                lengths = np.concatenate([np.diff(o) for _, o in chunks]) if chunks else np.zeros(0, np.int64)
                bags[j] = (np.concatenate([v for v, _ in chunks]) if chunks else np.zeros(0, np.int64),
                           offsets_of(lengths))
        return Rows(self.layout, self.rec, bags, self.keep, scratch=self.scratch)
