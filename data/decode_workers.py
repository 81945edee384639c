"""Parallel decode: N spawned processes, started once, each decode whole windows of an epoch.

    windows of the epoch (from start_step)   k0    k0+1   k0+2   k0+3   k0+4 ...
    worker (N = 2)                           w0    w1     w0     w1     w0
    consumer                                 takes window j's batches from worker j % N, in order

A window (``data/reader.py``: S rows of the rank's range, shuffled as one) is the unit
of work, so a worker does exactly what the one-thread reader does for it: the batches,
and the records of dropped rows, are the same and come out in the same order, at any
worker count. Each worker's queue holds at most ``depth`` batches, so a worker runs at
most that far ahead. Items travel as the reader's :class:`Transport` says: a worker
decodes each batch straight into a slot of its shared memory, the trainer gets tensors
viewing that slot (data/shm_batch.py), and only a small handle goes through the queue.

The workers live as long as their :class:`DecodePool` (one per reader): started at the
first epoch, they take each epoch as a task (its arguments and their windows), so an
epoch costs no process start. Each task carries a generation number; an epoch left
early (a break, an error, a resume) moves the generation on, the workers drop the rest
of that task, and the consumer skips any message of an older generation (freeing its
slot); a worker frees the slots of what it decoded for a dropped task itself.

Errors: a worker's exception (a DataError under ``on_error="fail"``) is sent to the
consumer and raised there when it reaches that window, exactly where the one-thread
reader raises it. A worker that dies (killed, out of memory) is a
:class:`DecodeWorkerError`, one line, as soon as the consumer waits on it; the next
epoch starts a fresh pool. The batches already handed out stay valid: the consumer's
mappings of a worker's shared memory outlive the worker. The pool then closes: it stops
the other workers and unlinks every block a worker made, named or half made (its names
are the pool's, data/shm_batch.py), as ``close`` always does.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import select
import signal
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from data.background import in_background
from data.errors import UserError
from data.shm_batch import Abandoned, forget_maps, new_prefix, unlink_blocks

T = TypeVar("T")
_ITEM, _END, _ERROR = range(3)
_POLL_S = 0.1  # how often a waiting consumer checks that its worker is alive
# slots a worker's items occupy beyond the queue and the consumer's: two decoded ahead
# (in_background), one being decoded, one being put, one being received
IN_FLIGHT = 5

# What the forkserver imports before it forks: each worker starts with torch and the reader
# imported, and with SIGTERM ignored (data/forkserver_signals.py). One process has one
# forkserver, whoever starts it first: the tests' ranks (tests/multiprocess.py) ask for
# the same list and undo the SIGTERM part in each rank.
FORKSERVER_PRELOAD = ["data.forkserver_signals", "data.reader", "pyarrow.parquet", "pyarrow.compute"]


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
    """How an item crosses from a worker to the consumer, through shared slots whose
    states both map (``state``: a byte array, one per slot; data/shm_batch.py).

    ``ring(state, prefix)`` makes, in the worker, an object with ``start(alive)`` at each task,
    ``alloc`` (handed to the factory: where items are written), ``pack(item)`` (something
    small to pickle), ``unsent(message)`` (a packed item that was not sent after all) and
    ``close()`` at exit, naming its shared memory ``{prefix}-...`` (what the pool
    unlinks once the worker is gone). ``receiver(state)`` makes, in the consumer,
    one with ``unpack(message)`` and ``discard(message)`` (a message never handed out).
    The consumer keeps at most ``hold`` items of a worker in its slots (it copies past
    that). Module-level functions: they are pickled to the workers."""

    ring: Callable[[Any], Any]
    receiver: Callable[[Any], Any]
    hold: int


class DecodePool:
    """``workers`` processes, each holding the ``factory`` of the epoch that started
    them (pickled once, then): ``factory(*args, alloc)`` makes, in the worker, the window
    function of one epoch, writing its items with ``alloc`` (the transport's). The pool
    keeps no reference to the factory (the reader)."""

    def __init__(self, workers: int, depth: int, transport: Transport) -> None:
        self.workers, self.depth, self.transport = workers, depth, transport
        self.procs: list = []

    def pids(self) -> list[int]:
        """The live workers' process ids (none before the first epoch)."""
        return [p.pid for p in self.procs if p.is_alive()]

    def _start(self, factory: Callable[..., Callable[[int], Iterable[T]]]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self.stop = ctx.Event()
        self.generation = ctx.RawValue("q", 0)
        self.tasks = [ctx.Queue() for _ in range(self.workers)]
        self.queues = [ctx.Queue(maxsize=self.depth) for _ in range(self.workers)]
        states = [ctx.RawArray("b", self.depth + self.transport.hold + IN_FLIGHT)
                  for _ in range(self.workers)]
        self.receivers = [self.transport.receiver(state) for state in states]
        self.prefix = new_prefix()  # of the workers' shared memory, unlinked by close()
        self.procs = [ctx.Process(target=_serve, name=f"ParquetDecode-{i}", daemon=True,
                                  args=(factory, self.tasks[i], self.queues[i], self.stop,
                                        self.generation, self.transport.ring, states[i],
                                        f"{self.prefix}-w{i}", os.getpid()))
                      for i in range(self.workers)]
        # Run before multiprocessing's own exit hook (atexit runs the last registered
        # first), which SIGTERMs daemon workers, now ignored, and joins them with no
        # timeout: a trainer exiting without close() waited for ever.
        self._at_exit = functools.partial(_close_pool, weakref.ref(self))
        atexit.register(self._at_exit)
        for p in self.procs:
            p.start()

    def epoch(self, factory: Callable[..., Callable[[int], Iterable[T]]], args: tuple,
              windows: list[int], tail: Iterable[T]) -> Iterator[T]:
        """The items of ``factory(*args)(k)`` for each k of ``windows`` in order, then
        ``tail``; ``factory`` is the same at every epoch (the workers hold their copy)."""
        if any(not p.is_alive() for p in self.procs):
            self.close()  # one died (in an earlier epoch): a fresh pool
        if windows and not self.procs:
            self._start(factory)
        n = len(self.procs)
        if n:
            self.generation.value += 1
            gen = self.generation.value
            for i in range(n):
                self.tasks[i].put((gen, args, windows[i::n]))
        try:
            for j in range(len(windows)):
                while True:
                    kind, item = self._get(j % n, gen)
                    if kind == _END:
                        break
                    if kind == _ERROR:
                        raise item
                    yield self.receivers[j % n].unpack(item)
            yield from tail
        finally:
            if n:
                self.generation.value += 1  # left early or not: the workers drop the task

    def _get(self, i: int, gen: int) -> tuple[int, object]:
        """Worker i's next message of generation ``gen`` (older ones are skipped, their
        slots freed)."""
        while True:
            try:
                message = _get(self.queues[i], self.procs[i], i)
            except DecodeWorkerError:
                self.close()  # what the dead worker made, even half, is unlinked now
                raise
            if message[0] == gen:
                return message[1:]
            if message[1] == _ITEM:
                self.receivers[i].discard(message[2])

    def close(self) -> None:
        """Stop the workers (they unlink their shared memory) and wait for them; then
        unlink what a worker that died or was killed left under the pool's prefix."""
        if not self.procs:
            return
        self.stop.set()
        for p in self.procs:
            if p.pid is None:  # never started: a start cut short (a signal, a failed fork)
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in [*self.queues, *self.tasks]:
            q.cancel_join_thread()
            q.close()
        self.procs = []
        atexit.unregister(self._at_exit)
        unlink_blocks(self.prefix)  # every worker is gone: none is using them
        forget_maps(self.prefix)  # their memory goes with the last batch viewing it


def _close_pool(pool: weakref.ref) -> None:
    live = pool()
    if live is not None:
        live.close()


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
    why = ("SIGBUS: /dev/shm full? give it more room or set data.workers lower" if code == -signal.SIGBUS
           else "killed? out of memory? try data.workers=0")
    return DecodeWorkerError(f"Parquet decode worker {i} died (exit code {code}) before "
                             f"sending its batches ({why})")


def _serve(factory: Callable[..., Callable[[int], Iterable[T]]], tasks: object, q: object,
           stop: object, generation: object, make_ring: Callable[[Any, str], Any],
           state: object, prefix: str, trainer: int) -> None:
    """A worker's life: task after task (an epoch's windows) until ``stop`` or the end
    of the ``trainer`` process; then it unlinks its shared memory (named under ``prefix``).

    SIGINT and SIGTERM are the trainer's to act on: a Ctrl-C, SLURM's preemption or
    torchrun's stop signals a whole process group, and a worker that died of it made
    the trainer's graceful stop (a checkpoint, exit 75) a "decode worker died" error.
    The trainer stops its workers itself; if it is killed outright (the OOM killer),
    they notice within a poll and exit, where before they, the forkserver and every
    shared-memory block they held outlived it."""
    import pyarrow as pa
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the forkserver gives its children the default
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as the forkserver has it
    torch.set_num_threads(1)
    pa.set_cpu_count(1)  # N workers on N cores: no pool of decode threads in each of them
    owner = _Owner(trainer)
    ring = make_ring(state, prefix)
    try:
        while not stop.is_set() and owner.alive():  # type: ignore[attr-defined]
            try:
                gen, args, ks = tasks.get(timeout=_POLL_S)  # type: ignore[attr-defined]
            except queue.Empty:
                continue

            def alive(gen: int = gen) -> bool:
                return (not stop.is_set() and generation.value == gen  # type: ignore[attr-defined]
                        and owner.alive())

            ring.start(alive)
            _work(factory(*args, ring.alloc), ks, gen, q, alive, ring)
    finally:
        ring.close()


class _Owner:
    """Whether the trainer process lives: a pidfd (Linux 5.3+: readable once it ends, no
    pid reuse to fool it), else a signal-0 probe."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.fd = None

    def alive(self) -> bool:
        if self.fd is not None:
            return not select.select([self.fd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _work(window: Callable[[int], Iterable[T]], ks: list[int], gen: int, q: object,
          alive: Callable[[], bool], ring: Any) -> None:
    """One task: each of its windows' items, then an end mark, in order, each tagged
    ``gen``; an exception goes to the consumer. Dropped once ``alive()`` is false (the
    generation moved on)."""

    def put(message: tuple) -> bool:
        while alive():
            try:
                q.put((gen, *message), timeout=_POLL_S)  # type: ignore[attr-defined]
                return True
            except queue.Full:
                pass
        return False

    # decoding runs a thread ahead (the GIL is released in pyarrow); packing here, in order
    items = in_background(_stream(window, ks), 2)
    try:
        for kind, item in items:
            message = ring.pack(item) if kind == _ITEM else None
            if not put((kind, message)):
                if kind == _ITEM:
                    ring.unsent(message)  # its slot: never to be received
                break  # the consumer left this epoch
    except Abandoned:
        pass  # waited for a slot while the consumer left this epoch
    except Exception as e:  # noqa: BLE001 - raised in the consumer, at this window
        put((_ERROR, e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        items.close()  # type: ignore[attr-defined]


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
