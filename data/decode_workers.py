"""Parallel decode: N spawned processes each decode whole windows of an epoch.

    windows of the epoch (from start_step)   k0    k0+1   k0+2   k0+3   k0+4 ...
    worker (N = 2)                           w0    w1     w0     w1     w0
    consumer                                 takes window j's batches from worker j % N, in order

A window (``data/reader.py``: S rows of the rank's range, shuffled as one) is the unit
of work, so a worker does exactly what the one-thread reader does for it: the batches,
and the records of dropped rows, are the same and come out in the same order, at any
worker count. Each worker's queue holds at most ``depth`` batches, so a worker runs at
most that far ahead. Items travel as the reader's :class:`Transport` says: a batch in
one shared-memory block (data/shm_batch.py), only its handle through the queue.

Errors: a worker's exception (a DataError under ``on_error="fail"``) is sent to the
consumer and raised there when it reaches that window, exactly where the one-thread
reader raises it. A worker that dies (killed, out of memory) is a
:class:`DecodeWorkerError`, one line, as soon as the consumer waits on it. Workers stay
alive until the consumer is done, because a tensor's shared memory is handed over by
its sender; abandoning the iterator stops them.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from data.background import in_background
from data.errors import UserError

T = TypeVar("T")
_ITEM, _END, _ERROR = range(3)
_POLL_S = 0.1  # how often a waiting consumer checks that its worker is alive


class DecodeWorkerError(UserError):
    """A decode worker process died without reporting an error."""


def auto_workers(cores: int, local_ranks: int, trainer_threads: int) -> int:
    """``data.workers=auto``: the cores the training processes leave free, per rank:
    cores ÷ local ranks, minus the threads each trainer runs itself; at least 0."""
    return max(0, cores // max(1, local_ranks) - trainer_threads)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Transport:
    """How an item crosses from a worker to the consumer: ``packer(depth)`` makes, in
    the worker, its ``(pack, close)``: pack turns an item into something small to pickle
    (a shared-memory handle) that stays valid while at most ``depth`` more items are
    queued; close runs when the worker exits. ``unpack`` runs in the consumer.
    Module-level functions: they are pickled to the workers."""

    packer: Callable[[int], tuple[Callable[[Any], Any], Callable[[], None]]]
    unpack: Callable[[Any], Any]


def in_workers(window: Callable[[int], Iterable[T]], windows: list[int], tail: Iterable[T],
               workers: int, depth: int, transport: Transport) -> Iterator[T]:
    """The items of ``window(k)`` for each k of ``windows`` in order, then ``tail``,
    decoded by ``workers`` processes (``window`` is pickled to them)."""
    import multiprocessing as mp

    n = max(1, min(workers, len(windows)))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["data.reader", "pyarrow.parquet", "pyarrow.compute"])  # each worker forks with torch imported
    stop = ctx.Event()
    queues = [ctx.Queue(maxsize=depth) for _ in range(n)]
    procs = [ctx.Process(target=_work, args=(window, windows[i::n], queues[i], stop, transport.packer, depth),
                         name=f"ParquetDecode-{i}", daemon=True) for i in range(n)]
    if not windows:
        procs = []
    try:
        for p in procs:
            p.start()
        for j in range(len(windows)):
            while True:
                kind, item = _get(queues[j % n], procs[j % n], j % n)
                if kind == _END:
                    break
                if kind == _ERROR:
                    raise item
                yield transport.unpack(item)
        yield from tail
    finally:
        stop.set()
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in queues:
            q.cancel_join_thread()
            q.close()


def _get(q: queue.Queue, proc: object, i: int) -> tuple[int, object]:
    """The next message of worker ``i``; a worker found dead is a DecodeWorkerError."""
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            if not proc.is_alive():  # type: ignore[attr-defined]
                try:  # its last message may have landed just before it died
                    return q.get(timeout=_POLL_S)
                except queue.Empty:
                    raise _died(proc, i) from None
        except (EOFError, OSError) as e:  # a tensor's shared memory whose sender is gone
            proc.join(timeout=5)  # type: ignore[attr-defined]
            if proc.is_alive():  # type: ignore[attr-defined]
                raise
            raise _died(proc, i) from e


def _died(proc: object, i: int) -> DecodeWorkerError:
    code = proc.exitcode  # type: ignore[attr-defined]
    return DecodeWorkerError(f"Parquet decode worker {i} died (exit code {code}) before "
                             "sending its batches (killed? out of memory? try data.workers=0)")


def _work(window: Callable[[int], Iterable[T]], ks: list[int], q: object, stop: object,
          packer: Callable[[int], tuple[Callable[[Any], Any], Callable[[], None]]],
          depth: int) -> None:
    """A worker's life: each of its windows' items, then an end mark, in order; an
    exception goes to the consumer. It waits for ``stop`` before exiting: the consumer
    may still be mapping the shared memory of the last tensors it sent."""
    import torch

    torch.set_num_threads(1)
    pack, close = packer(depth)

    def put(message: tuple[int, object]) -> bool:
        while not stop.is_set():  # type: ignore[attr-defined]
            try:
                q.put(message, timeout=_POLL_S)  # type: ignore[attr-defined]
                return True
            except queue.Full:
                pass
        return False

    # decoding runs a thread ahead (the GIL is released in pyarrow); packing here, in order
    items = in_background(_stream(window, ks), 2)
    try:
        for kind, item in items:
            if not put((kind, pack(item) if kind == _ITEM else None)):
                break  # the consumer is gone
    except Exception as e:  # noqa: BLE001 - raised in the consumer, at this window
        put((_ERROR, e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        items.close()  # type: ignore[attr-defined]
    stop.wait()  # type: ignore[attr-defined]
    close()


def _stream(window: Callable[[int], Iterable[T]], ks: list[int]
            ) -> Generator[tuple[int, T | None], None, None]:
    """Each window's items, then its end mark."""
    for k in ks:
        for item in window(k):
            yield _ITEM, item
        yield _END, None


def _picklable(e: BaseException) -> bool:
    """Whether ``e`` survives the queue (an unpicklable one would be lost, and the
    consumer would wait on a live worker for ever)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:  # noqa: BLE001
        return False
