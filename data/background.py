"""A generator run in a daemon thread, a bounded number of items ahead of its consumer.

Used by the reader (data/reader.py: decode ahead of training) and by each decode
worker (data/decode_workers.py: the next window decoded while this one's batches are
packed). The source's exceptions re-raise in the consumer; abandoning the iterator
(break, ``close()``, garbage) stops the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator
from typing import TypeVar

T = TypeVar("T")
_ITEM, _DONE, _ERROR = range(3)


def in_background(source: Generator[T, None, None], depth: int) -> Iterator[T]:
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
