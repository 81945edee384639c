"""The host tier of one process: every row in one stacked ``LocalEmbeddingCollection``.

    forward:   unique cold ids ──index_select on the host──► rows [U, D]
               ──copy (CUDA: pinned buffer, side stream)──► ColdRows on the device
               pooled bag = Σ hot part + Σ cold part  (mean: each id scaled by
               1 / FULL bag length, as the single-process collection does)
    backward:  cold KVGradient (stacked ids, moved home) ──► host optimizer
               (applied at once when fused, else kept until step())

One step's ordering (CUDA; kept gradients, one pass per mini-batch as the trainer runs it):

    main thread   | hot lookups, bottom MLP | wait gather | cold part, top, backward | step() ─┐ submit next gather
    split stream  | H2D batch, classify, header D2H (split.py; a step ahead)                   │
    gather thread | wait host updates ─► gather rows (N threads) ─► pinned ─► H2D issue        │
    copy stream   |                       H2D rows ─► event ready                              │
    compute stream|  ... waits `ready` before the cold lookup (no host wait) ... D2H grads ─► event
    update thread |                              waits the D2H events, applies ◄┘ (queued)
                  the NEXT step's gather waits for this queue (``collection``): read after write.

A captured step whose cold rows are staged (cold_stage.py) sends home its updated rows
and state instead (``write_back``: the update thread stores them); the next gather waits
for the updates before that write-back only, and the rows it reads while it runs are
``ColdRows.stale``: the next static step patches them on the device, any other use
reads them again (``resolve``).

Host waits left in the main thread: the split's 56-byte header (the micro-batches'
shapes depend on it; it waits for the split stream, not for the compute stream; the
trainer splits each mini-batch a step ahead and reads its header at the end of the
step before, dlrm/train/hotline.py), the
torch path's KV-gradient ``unique_consecutive`` of the hot lookups (the Triton
sorted backward has none; the cold side's ids are known: ``covers``), and the wait for
the gather thread (a Python future, not a device sync).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from embeddings.collection import LocalEmbeddingCollection
from embeddings.host_rows import gather_rows, prepare, store_rows
from embeddings.hotline.hot_tier import HotTier
from embeddings.hotline.lookups import ColdPooled, ColdRows
from embeddings.hotline.mapped import MappedTables
from embeddings.hotline.profile import in_sorted
from embeddings.hotline.split import MicroLookups
from embeddings.jagged import bag_offsets
from embeddings.kv import KVGradient
from embeddings.lookup import pooled_lookup
from embeddings.optim import SparseOptimizer
from embeddings.table import Pooling, TableSpec
from embeddings.timing import section


class LocalHostTier:
    """``HostTier`` of one process (see host_tier.py)."""

    plan = None
    collective = False

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizer,
        fused: bool,
        seed: int | None,
        device: torch.device | str,
        hot_device: torch.device,
        gather_threads: int = 1,
        rounding_seed: int | None = None,
    ) -> None:
        """Tables on ``device`` (the host), cold rows copied to ``hot_device``, gathered
        by ``gather_threads`` host threads of ours (embeddings/host_rows.py; 1: the
        gather thread itself; 0: one ``index_select``, parallel over torch's intra-op
        threads); cold rows travel in the tables' type (fp16/bf16: half the bytes) and
        pool in fp32."""
        # Pageable host memory on 2 MiB pages, not page-locked: rows cross to and from a
        # GPU through pinned buffers of their own (gather_cold, write_back, the gradient's
        # D2H), never by DMA from the tables. Page-locked, torch's host allocator rounded
        # the tables up to a power of two (bench_gpu's 8.6 GB: 16 GB locked) on 4 KiB
        # pages, where a random gather of 4,500 rows of 256 B from 5 GB took 0.23 ms
        # against 0.16 on 2 MiB pages (this 2-core machine).
        self._tables = LocalEmbeddingCollection(tables, optimizer, fused=True, seed=seed, device=device,
                                                rounding_seed=rounding_seed)
        # Host updates (cold gradients, lr) run in order on one thread, off the step.
        self._updates = ThreadPoolExecutor(1, thread_name_prefix="hotline-host-update")
        self._pending: Future[None] | None = None
        # The newest queued update that writes rows (the future, the rows' ids) and the
        # task queued just before it: a gather waits for that one, and for the newest
        # only to read the rows it writes (``_gather_updated``)
        self._writing: tuple[Future[None], torch.Tensor, bool] | None = None  # bool: a write-back
        self._before_writing: Future[None] | None = None
        # The host ids the next gather will read (``expect_reads``: the next mini-batch's
        # unique cold ids, split a step ahead), and the event after their D2H copy. The
        # next queued update writes those rows first and says so in ``_first_written``
        # ((the future, those ids)): the gather then waits for them only.
        self._next_reads: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._first_written: tuple[Future[None], torch.Tensor] | None = None
        self._lr: float | None = None  # the last lr queued for the host tables
        # A static step's staged cold rows (cold_stage.py): gathers bring each row's
        # optimizer state too; ``writes`` counts the queued writes of host rows (updates,
        # write-backs, ``write_rows``), so a stage knows whether its rows still stand.
        self.stage_state = False
        self.writes = 0
        self._copy_stream = torch.cuda.Stream(hot_device) if hot_device.type == "cuda" else None
        self.optimizer = optimizer
        self.fused = fused
        self.mean = tables[0].pooling is Pooling.MEAN
        # Our threads run numba kernels, each exactly one thread (embeddings/host_rows.py).
        # Torch's calls are each a parallel region as wide as the machine: on the
        # 2026-11-27 H200 (16 cores beside 15 decode workers) the captured step's gather
        # of ~1 MB took 1.7 ms a step over 4 threads of ours each calling index_select,
        # 1.3 ms as one call (0: kept to compare), 0.05-0.22 ms alone
        self.gather_threads = gather_threads
        if gather_threads:  # numba started, the kernels loaded, before any step
            prepare([self._tables.weight.data, *self._tables.state.values()])
        self._gather_pool = (ThreadPoolExecutor(gather_threads, thread_name_prefix="hotline-rows")
                             if gather_threads > 1 else None)
        self._kept: list[tuple[KVGradient, torch.cuda.Event | None]] = []
        # Bytes of the cold path's copies between host and device (H2D: rows and
        # ids; D2H: gradient rows and ids), counted where they are issued.
        self.copied = {"h2d": 0, "d2h": 0, "copies": 0}
        self.update_cpu_s = 0.0  # the update thread's CPU time in its tasks (the trainer's stats)
        # hotline.cold_path=mapped: the tables registered with CUDA, read in place by the
        # device (mapped.py; None: gathered on the host)
        self._mapped: MappedTables | None = None
        # their device views, made once: the weight's, each per-row state's by name
        self._in_place: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
        self._device_writes: torch.cuda.Event | None = None  # after the device's last write into them

    def _count(self, way: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.copied[way] += t.numel() * t.element_size()
            self.copied["copies"] += 1

    @property
    def device(self) -> torch.device:
        return self._tables.weight.device

    # ------------------------------------------------------------------ hot rows
    @torch.no_grad()
    def read_rows(
        self, stacked_ids: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        host_ids = stacked_ids.to(self.device)
        weight = self.collection.weight.data.index_select(0, host_ids).to(device)
        fresh = self.optimizer.init_state(stacked_ids.numel(), self.collection.dim, device)
        per_row = self.optimizer.per_row_state()
        host_state = self.collection.state
        for name, tensor in fresh.items():
            src = host_state[name]
            tensor.copy_(src.index_select(0, host_ids) if name in per_row else src)
        return weight, fresh

    @torch.no_grad()
    def write_rows(
        self, stacked_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> None:
        self.wait_updates()
        self.writes += 1
        self._write(stacked_ids.to(self.device), weight, state)

    @torch.no_grad()
    def write_rows_later(
        self, stacked_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> None:
        """``write_rows`` queued on the host-update thread behind the updates queued
        before: a refresh's leaving rows (refresh.py ``swap``), which the step loop then
        neither waits for (CUDA: D2H into pinned memory on the current stream, no sync)
        nor stores. Every reader of the host rows waits for it as for an update: a
        gather of those rows (``_gather_updated``: a write, not a write-back), every
        other reader through ``collection``."""
        ready = None
        if weight.device.type == "cuda":
            weight = _pinned_copy(weight)
            state = {name: _pinned_copy(t) if t.device.type == "cuda" else t.clone() for name, t in state.items()}
            ready = torch.cuda.Event()
            ready.record()
        else:  # the caller's tensors may change once this returns (the hot tier's)
            weight, state = weight.clone(), {name: t.clone() for name, t in state.items()}
        host_ids = stacked_ids.to(self.device)
        before = self._pending
        self._later(self._write_when, host_ids, weight, state, ready)
        self._writing, self._before_writing = (self._pending, host_ids, False), before
        self._first_written = None
        self.writes += 1

    def _write_when(self, host_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor],
                    ready: torch.cuda.Event | None) -> None:
        """On the host-update thread: ``write_rows_later``'s rows once they are home."""
        if ready is not None:
            ready.synchronize()
        self._write(host_ids, weight, state)

    def _write(self, host_ids: torch.Tensor, weight: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Rows and their state into the tables (the updates queued before are in)."""
        tables = self._tables
        tables.weight.data.index_copy_(0, host_ids, weight.to(host_ids.device))
        per_row = self.optimizer.per_row_state()
        for name, tensor in state.items():
            dst = tables.state[name]
            if name in per_row:
                dst.index_copy_(0, host_ids, tensor.to(dst.device))
            else:
                dst.copy_(tensor)

    # ------------------------------------------------------------------ cold rows
    def read_in_place(self, device: torch.device) -> None:
        """hotline.cold_path=mapped: from now on the device reads the cold rows from the
        tables in place (mapped.py): the weight and each row's optimizer state are
        registered with CUDA now, at the run's start (RuntimeError where CUDA refuses:
        the gather stays the host's). On the CPU the tables are read as they are."""
        mapped = MappedTables(device)
        try:
            # made once: the tables are allocated once (collection.py) and loaded in place
            self._in_place = (mapped.view(self._tables.weight.data),
                              {name: mapped.view(self._tables.state[name])
                               for name in self.optimizer.per_row_state()})
        except Exception:
            mapped.close()
            raise
        self._mapped = mapped

    @property
    def reads_in_place(self) -> bool:
        """Whether the device reads the cold rows in place (``read_in_place``)."""
        return self._in_place is not None

    def read_on_host(self) -> None:
        """The host gathers the cold rows again; the tables' registration is undone
        once the device's queued reads are done."""
        mapped, self._mapped, self._in_place = self._mapped, None, None
        if mapped is not None:
            mapped.close()  # after the device's queued reads and writes
            self._device_writes = None

    def gather_cold(self, micro: MicroLookups, device: torch.device) -> ColdRows:
        """The mini-batch's unique cold rows (classified on the device: ``micro.cold_ids``),
        copied to ``device``. CUDA: the ids come back in one D2H copy (made a step
        ahead by the trainer where ``micro.cold_host_ids`` holds them), the rows are
        gathered into a pinned buffer and go over in one H2D copy, both on a side
        stream ordered by events, so the trainer's compute goes on meanwhile. Runs on
        the gather thread: its host waits (the ids' copy) are not the trainer's."""
        if self._in_place is not None:
            return self._gather_mapped(micro, self._in_place)
        source = self._tables.weight.data  # read after the queued updates of its rows (_gather_updated)
        t0 = time.perf_counter()
        ids = micro.cold_ids
        cuda = device.type == "cuda" and source.device.type == "cpu"
        ids_wait = 0.0
        if cuda and micro.cold_host_ids is not None:  # copied a step ahead (dlrm/train/hotline.py)
            if micro.cold_host_ready is not None:
                micro.cold_host_ready.synchronize()  # this thread's wait; the copy was queued a step ago
                ids_wait = time.perf_counter() - t0
            host_ids = micro.cold_host_ids
            rows = torch.empty(ids.numel(), source.shape[1], dtype=source.dtype, pin_memory=True)
        elif cuda:
            caller = torch.cuda.current_stream(device)  # where ids classified outside the trainer were
            with torch.cuda.stream(self._copy_stream):
                if micro.ready is not None:
                    self._copy_stream.wait_event(micro.ready)  # the split stream classified them
                elif ids.device.type == "cuda":
                    self._copy_stream.wait_stream(caller)
                host_ids = _pinned_copy(ids)
                if ids.device.type != "cuda":  # classified on the host (outside the trainer)
                    ids = host_ids.to(device, non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record(self._copy_stream)
            arrived.synchronize()  # this thread waits for U ids, the trainer does not
            ids_wait = time.perf_counter() - t0
            rows = torch.empty(ids.numel(), source.shape[1], dtype=source.dtype, pin_memory=True)
        else:
            host_ids = ids.to(source.device) if micro.cold_host_ids is None else micro.cold_host_ids
            rows = source.new_empty(ids.numel(), source.shape[1])
        self._count("d2h", host_ids)
        state = self._state_like(host_ids.numel(), pinned=cuda)
        late, waited, stale = self._gather_updated(self._sources(source, state, rows), host_ids)
        t1 = time.perf_counter()
        ready = None
        if cuda:
            with torch.cuda.stream(self._copy_stream):  # a side stream: compute goes on
                rows = rows.to(device, non_blocking=True)
                state = {name: t.to(device, non_blocking=True) for name, t in state.items()}
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)  # pool() makes the compute stream wait on it
            # No synchronize(): the copy is ordered by ``ready``, not by a host wait. The
            # pinned source stays alive until the copy ends: the caching host allocator
            # holds a pinned block until the stream's work on it is done.
        else:
            rows = rows.to(device)
            state = {name: t.to(device) for name, t in state.items()}
        self._count("h2d", rows, *state.values())
        return ColdRows(ids, rows.requires_grad_(True), host_ids, t1 - t0 - waited, time.perf_counter() - t1, ready,
                        late_rows=late, update_wait_s=waited, ids_wait_s=ids_wait, state=state or None,
                        stale=stale)

    def _gather_mapped(self, micro: MicroLookups, views: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> ColdRows:
        """``gather_cold`` read in place (mapped.py), on the calling thread's current
        stream: the device gathers the rows (and, staged, their state) from the tables'
        device ``views`` with one ``index_select`` each, once the host writes it must see
        are in (``_mapped_waits``). The host ids (an eager step's gradient's, the refresh
        window's) are the copy made a step ahead, or one made here."""
        t0 = time.perf_counter()
        ids = micro.cold_ids
        if micro.cold_host_ids is not None:
            if micro.cold_host_ready is not None:
                micro.cold_host_ready.synchronize()  # queued a step ago
            host_ids = micro.cold_host_ids
        else:
            host_ids = ids.to(self.device)
        ids_wait = time.perf_counter() - t0
        waited = self._mapped_waits()
        t1 = time.perf_counter()
        if ids.device.type == "cuda":
            if micro.ready is not None:  # classified on the split stream
                torch.cuda.current_stream(ids.device).wait_event(micro.ready)
            ids.record_stream(torch.cuda.current_stream(ids.device))
        weight, per_row = views
        ids = ids.to(weight.device)
        rows = weight.index_select(0, ids)
        state = {name: t.index_select(0, ids) for name, t in per_row.items()} if self.stage_state else {}
        self._count("h2d", rows, *state.values())  # read over the bus, in place
        return ColdRows(ids, rows.requires_grad_(True), host_ids, t1 - t0 - waited - ids_wait,
                        time.perf_counter() - t1, None, update_wait_s=waited, ids_wait_s=ids_wait,
                        state=state or None)

    def _mapped_waits(self) -> float:
        """Before the device reads rows in place: every queued host write of rows is in
        (the newest row-writing task on the update thread, and by its FIFO those before:
        an eager step's update, a refresh's leaving rows). The static steps' write-backs
        are the device's own (``_write_in_place``), ordered on its stream: nothing is
        stale. Seconds waited."""
        t0 = time.perf_counter()
        writing = self._writing
        if writing is not None:
            writing[0].result()
        return time.perf_counter() - t0

    def _state_like(self, unique: int, pinned: bool) -> dict[str, torch.Tensor]:
        """Empty rows for ``unique`` rows' per-row optimizer state (none: not staged)."""
        if not self.stage_state:
            return {}
        host = self._tables.state
        return {name: torch.empty((unique, *host[name].shape[1:]), dtype=host[name].dtype, pin_memory=pinned)
                for name in self.optimizer.per_row_state()}

    def _sources(self, weight: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host tensor, rows out) pairs a gather fills: the weight, then each staged state."""
        return [(weight, rows)] + [(self._tables.state[name], out) for name, out in state.items()]

    def _gather_updated(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], host_ids: torch.Tensor
                        ) -> tuple[int, float, tuple[torch.Tensor, Future[None]] | None]:
        """``out[i] = source[host_ids[i]]`` for each (source, out) of ``pairs``, as the
        sources are after every queued host update, waiting only for the updates of the
        rows it reads: the newest row-writing update (the last step's cold rows) may
        still run; every row is gathered at once, and those that update writes are
        gathered again after it ends (exact: the others it does not touch, and every
        update before it is waited for). Where that update is a static step's
        write-back (cold_stage.py), they are not: the next static step patches them,
        any other use reads them again (``resolve``). (rows read after that update or
        left stale, seconds waited for updates, the stale rows and their write-back)."""
        t0 = time.perf_counter()
        writing, before = self._writing, self._before_writing
        if writing is None or writing[0].done():  # FIFO: every row-writing update is in
            if writing is not None:
                writing[0].result()  # its error, if any, raises here (as wait_updates would)
            for source, out in pairs:
                self._gather_rows(source, host_ids, out)
            return 0, time.perf_counter() - t0, None
        if before is not None:
            before.result()
        waited = time.perf_counter() - t0
        for source, out in pairs:  # the rows the update writes: read again below
            self._gather_rows(source, host_ids, out)
        # a write-back's ids are a static step's staged ones, ascending: a sorted search
        # (4,500 against 4,500: 61 us here where isin, which sorts both, took 233, on the
        # gather thread, in the step's critical path); an update's may be several cat'd
        written = in_sorted(host_ids, writing[1]) if writing[2] else torch.isin(host_ids, writing[1])
        late = written.nonzero().flatten()
        if writing[2]:  # a write-back: left to the patch (or ``resolve``)
            return int(late.numel()), waited, ((late, writing[0]) if late.numel() else None)
        t1 = time.perf_counter()
        first = self._first_written
        if first is not None and first[1].shape == host_ids.shape and torch.equal(first[1], host_ids):
            first[0].result()  # this gather's rows were written first (``expect_reads``)
        else:
            writing[0].result()
        waited += time.perf_counter() - t1
        if late.numel():
            late_ids = host_ids.index_select(0, late)
            for source, out in pairs:
                out.index_copy_(0, late, source.index_select(0, late_ids))
        return int(late.numel()), waited, None

    def resolve(self, cold: ColdRows, with_state: bool = False) -> ColdRows:
        """``cold`` as a host read after every write would give it, for a use that no
        static step's patch covers: its stale rows (``ColdRows.stale``) read again
        after their write-back, copied into the device rows (an eager step after static
        ones, a stage that was invalidated); ``with_state``: the optimizer state of
        every row too, where the gather did not bring it (before the stage existed)."""
        fetch_state = with_state and cold.state is None and bool(self.optimizer.per_row_state())
        if cold.stale is None and not fetch_state:
            return cold
        if fetch_state:
            self.wait_updates()
        elif cold.stale is not None:
            cold.stale[1].result()
        tables = self._tables
        at = None if cold.stale is None else cold.stale[0]
        device = cold.rows.device
        with torch.no_grad():
            if device.type == "cuda" and cold.ready is not None:
                torch.cuda.current_stream(device).wait_event(cold.ready)  # after the gather's own copy
            if at is not None:
                ids, at_device = cold.host_ids.index_select(0, at), at.to(device)
                for source, out in self._sources(tables.weight.data, cold.state or {}, cold.rows):
                    out.index_copy_(0, at_device, source.index_select(0, ids).to(device))
            if fetch_state:
                cold.state = {name: tables.state[name].index_select(0, cold.host_ids).to(device)
                              for name in self.optimizer.per_row_state()}
        cold.stale = None
        return cold

    # Below this many rows one call gathers (hotline.gather_threads > 1): a hand-off
    # costs more than it saves.
    PARALLEL_ROWS = 4096

    def _gather_rows(self, source: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] = source[ids[i]]``: hotline.gather_threads of ours (embeddings/host_rows.py;
        one: this thread), or (0) one ``index_select`` over torch's intra-op threads."""
        if self.gather_threads == 0:
            torch.index_select(source, 0, ids, out=out)
            return
        many = self._gather_pool is not None and ids.numel() >= self.PARALLEL_ROWS
        gather_rows(source, ids, out, self._gather_pool if many else None, self.gather_threads)

    def hot_part(self, micro: MicroLookups, hot: HotTier) -> torch.Tensor:
        """Σ hot part per bag, [F*B, D] (mean: over the whole bag's length)."""
        return hot.lookup(micro.hot_slots, micro.hot_lengths, micro.num_features, micro.hot_scale,
                          micro.lengths, micro.source)

    def pool(
        self, micro: MicroLookups, hot: HotTier, cold: ColdRows | ColdPooled | None,
        hot_part: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Σ hot part + Σ cold part per bag, [B, F*D]; cold rows used. ``cold`` None: a
        popular micro-batch, no cold side at all (no empty embedding_bag, no backward
        for it; ``step`` still applies the host tier once). ``hot_part``: made already
        (``hot_part``: before the cold rows arrived)."""
        if hot_part is None:
            hot_part = self.hot_part(micro, hot)
        if cold is None:
            return self._pooled(micro, hot_part), 0
        assert isinstance(cold, ColdRows)
        cold = self.resolve(cold)  # after static steps: their write-back's rows read again
        if cold.rows.device.type == "cuda":  # copied on the side stream, used on this one
            current = torch.cuda.current_stream(cold.rows.device)
            if cold.ready is not None:
                current.wait_event(cold.ready)  # device-side order, the host does not wait
            cold.rows.record_stream(current)
        # Every cold row is used by a lookup (they are the unique cold ids), so the
        # gradient's ids are known: 0..U-1, in the order of ``cold.host_ids``.
        cold_part = pooled_lookup(cold.rows, micro.cold_local, bag_offsets(micro.cold_lengths),
                                  partial(self._receive, cold.host_ids), micro.cold_scale,
                                  covers=cold.rows.shape[0])
        return self._pooled(micro, hot_part + cold_part), cold.ids.numel()

    def _pooled(self, micro: MicroLookups, bags: torch.Tensor) -> torch.Tensor:
        """Feature-major bags [F*B, D] as [B, F*D]."""
        batch, features, dim = micro.batch, micro.num_features, self._tables.dim
        return bags.view(features, batch, dim).transpose(0, 1).reshape(batch, features * dim)

    # ------------------------------------------------------------------ updates
    def receive_rows(self, host_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """A captured step's cold gradient, ``rows`` [U, D] on the device (of
        ``host_ids``, in their order): home as a backward's would go (``_receive``).
        ``rows`` views the static step's buffer, which the next step's backward writes
        again while this step's host update may still read it: on CUDA the D2H copy is
        the tier's own, on the CPU (moving home is no copy there) it is cloned."""
        if rows.device.type != "cuda":
            rows = rows.clone()
        self._receive(host_ids, KVGradient(host_ids, rows))

    def _receive(self, host_ids: torch.Tensor, grad: KVGradient) -> None:
        """The cold gradient (rows of ids 0..U-1): its rows go home, D2H into pinned
        memory on CUDA, not waited for here; its ids are already there."""
        ready = None
        if grad.rows.device.type == "cuda":
            rows = _pinned_copy(grad.rows)
            ready = torch.cuda.Event()
            ready.record()
        else:
            rows = grad.rows.to(self.device)
        grad = KVGradient(host_ids, rows)
        self._count("d2h", grad.rows)
        if self.fused:
            if ready is not None:
                ready.synchronize()
            self.collection.apply_gradient(grad)
        else:
            self._kept.append((grad, ready))

    def has_kept(self) -> bool:
        return bool(self._kept)

    def kv_gradients(self, hot: list[KVGradient]) -> dict[str, KVGradient]:
        if not (hot or self._kept):
            return {}
        home = self.device
        grad = KVGradient.cat([KVGradient(g.ids.to(home), g.rows.to(home)) for g in hot]
                              + _arrived(self._kept))
        out = {}
        for t in self.collection.tables:
            start = self.collection.row_offsets[t.name]
            part = grad.slice_rows(start, start + t.rows)
            if len(part):
                out[t.name] = part
        return out

    def set_lr(self, lr: float) -> None:
        """Queued after the updates queued before it; an unchanged lr not at all (the
        trainer sets it every step: a hand-off to the update thread each time)."""
        if lr != self._lr:
            self._lr = lr
            self._later(self._tables.set_lr, lr)

    def expect_reads(self, host_ids: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """The host ids (sorted, unique) the next gather will read, complete after
        ``ready``: the next ``step``'s update writes those rows first, and that gather
        waits for them only, not for the whole update (``_gather_updated``)."""
        self._next_reads = (host_ids, ready)

    def step(self) -> None:
        """Queue the kept cold gradients' update on the host-update thread: the
        trainer goes on (the next popular micro-batch needs no host row); the next
        gather, and every other reader of the host rows, waits for it (see
        ``collection``)."""
        kept, self._kept = self._kept, []
        first, self._next_reads = self._next_reads, None
        if not kept and not self._tables.optimizer.counts_steps():
            # nothing to write, nothing to count (a static step's, whose cold rows go
            # home by write-back): no hand-off to the update thread, whose empty update
            # was ~0.85 ms a step of its time, GIL waits included, on the 2026-11-28 H200
            return
        before = self._pending
        written_first: Future[None] | None = Future() if first is not None else None
        self._later(self._apply, kept, first, written_first)
        written = [grad.ids for grad, _ in kept if grad.ids.numel()]
        if written:  # the newest update that writes rows, and what came before it (FIFO)
            self._writing, self._before_writing = (self._pending, torch.cat(written), False), before
            self.writes += 1
            self._first_written = (written_first, first[0]) if written_first is not None else None

    def write_back(self, host_ids: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor],
                   ids: torch.Tensor) -> None:
        """A static step's staged cold rows as the device updated them, ``rows`` [U, D]
        and ``state`` (views of the step's buffers, on the device) of ``host_ids``: D2H
        into pinned memory (CPU: cloned), stored by the host-update thread as they are
        (cold_stage.py). The next gather does not wait for it (``_gather_updated``).
        ``ids``: the same ids on the device. Read in place (``read_in_place``): the
        device writes them into the tables itself (``_write_in_place``)."""
        if self._in_place is not None:
            self._write_in_place(self._in_place, ids, rows, state)
            return
        ready = None
        if rows.device.type == "cuda":
            rows = _pinned_copy(rows)
            state = {name: _pinned_copy(t) for name, t in state.items()}
            ready = torch.cuda.Event()
            ready.record()
        else:
            rows, state = rows.clone(), {name: t.clone() for name, t in state.items()}
        self._count("d2h", rows, *state.values())
        before = self._pending
        self._later(self._store, host_ids, rows, state, ready)
        self._writing, self._before_writing = (self._pending, host_ids, True), before
        self._first_written = None
        self.writes += 1

    def _write_in_place(self, views: tuple[torch.Tensor, dict[str, torch.Tensor]], ids: torch.Tensor,
                        rows: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """``write_back`` read in place: one ``index_copy_`` a tensor into the mapped
        tables, on the current stream after the step that updated the rows. The device's
        next reads (the next gather) follow it on that stream, so no row is read before
        its write and nothing is stale; every host reader waits for it (``wait_updates``:
        the event after it), every host writer comes after it (a gradient's or a
        refresh's rows wait for their D2H copies, recorded later on the same stream)."""
        weight, per_row = views
        ids = ids.to(weight.device)
        with torch.no_grad():
            weight.index_copy_(0, ids, rows)
            for name, tensor in state.items():
                per_row[name].index_copy_(0, ids, tensor)
        if weight.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self._device_writes = done
        self._count("d2h", rows, *state.values())  # written over the bus, in place
        self.writes += 1

    def _store(self, host_ids: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor],
               ready: torch.cuda.Event | None) -> None:
        """On the host-update thread: ``write_back``'s rows and state into the tables."""
        if ready is not None:
            ready.synchronize()
        with section("embedding_update"):
            tables = self._tables
            # on this thread, not over torch's threads (embeddings/host_rows.py): those would
            # take the cores the next gather and the decode workers run on
            store_rows(tables.weight.data, host_ids, rows)
            for name, tensor in state.items():
                store_rows(tables.state[name], host_ids, tensor)

    def _apply(self, kept: list[tuple[KVGradient, torch.cuda.Event | None]],
               first: tuple[torch.Tensor, torch.cuda.Event | None] | None = None,
               written_first: Future[None] | None = None) -> None:
        """On the host-update thread: wait for the gradients' D2H copies, apply them
        as one step. ``first`` (the ids the next gather reads): those rows' part first,
        counting the step, then ``written_first`` is set, then the rest (the same rows,
        the same arithmetic: the optimizers are row by row)."""
        tables = self._tables
        try:
            if kept:
                grad = KVGradient.cat(_arrived(kept))
            else:
                grad = KVGradient.empty(tables.dim, tables.weight.device)
            if first is None or grad.ids.numel() == 0:
                tables.apply_gradient(grad)
            else:
                if first[1] is not None:
                    first[1].synchronize()  # their D2H copy, queued a step ago
                read_next = torch.isin(grad.ids, first[0])
                tables.apply_gradient(KVGradient(grad.ids[read_next], grad.rows[read_next]))
                _settle(written_first)
                tables.apply_gradient(KVGradient(grad.ids[~read_next], grad.rows[~read_next]), count=False)
        except BaseException as e:
            _settle(written_first, e)
            raise
        _settle(written_first)

    def _later(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn`` on the single host-update thread, after what was queued before."""
        self._pending = self._updates.submit(self._timed, fn, *args)

    def _timed(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)``, its CPU time on the update thread added to ``update_cpu_s``."""
        t0 = time.thread_time()
        try:
            fn(*args)
        finally:
            self.update_cpu_s += time.thread_time() - t0

    def wait_updates(self) -> None:
        """Until the queued host updates are applied (their error, if any, raises here),
        and the device's writes into the tables read in place are done."""
        pending = self._pending
        if pending is not None:
            pending.result()
        written = self._device_writes
        if written is not None:
            written.synchronize()

    @property
    def collection(self) -> LocalEmbeddingCollection:
        """The host tables, once the queued updates are in: every read goes through here."""
        self.wait_updates()
        return self._tables


def _settle(future: Future[None] | None, error: BaseException | None = None) -> None:
    """``future`` done (with ``error``), once; None or done already: nothing."""
    if future is None or future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _arrived(kept: list[tuple[KVGradient, torch.cuda.Event | None]]) -> list[KVGradient]:
    """The kept gradients, after their D2H copies ended (CUDA events; the host waits)."""
    for _, ready in kept:
        if ready is not None:
            ready.synchronize()
    return [grad for grad, _ in kept]
