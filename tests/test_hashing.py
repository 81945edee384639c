"""The string hash (data/hashing.py): the compiled kernel (data/hash_kernels.py) and
the numpy recipe give the bits of the pure-Python reference for every string."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from data import hashing
from tests.test_preprocess import py_hash_bytes


def _strings() -> list[bytes]:
    rng = np.random.default_rng(11)
    out = [b"", b"a", "é".encode(), b"\x00\xff" * 300]
    out += [bytes(rng.integers(0, 256, int(n)).astype(np.uint8)) for n in rng.integers(0, 24, 300)]
    return out


def _buffers(strings: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow binary array's offsets and data, read-only (as the reader passes them)."""
    arr = pa.array(strings, pa.large_binary())
    _, offsets, data = arr.buffers()
    return np.frombuffer(offsets, np.int64), np.frombuffer(data, np.uint8)


@pytest.mark.parametrize("compiled", [True, False])
def test_string_hash_equals_the_python_reference(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from data import hash_kernels

    if compiled and hash_kernels.hash_strings() is None:
        pytest.skip("numba is not installed")
    if not compiled:
        monkeypatch.setattr(hashing, "hash_strings", lambda: None)
    strings = _strings()
    offsets, data = _buffers(strings)
    want = np.array([py_hash_bytes(s) for s in strings], dtype=np.uint64)
    assert np.array_equal(hashing.hash_bytes(offsets, data), want)
    # a slice whose offsets do not start at 0 (a chunk of a longer array)
    assert np.array_equal(hashing.hash_bytes(offsets[100:201], data), want[100:200])


def test_the_compiled_string_hash_lets_other_threads_run() -> None:
    """The reader hashes strings on its decoding thread beside the trainer's: the
    compiled kernel releases the GIL (``nogil``). While ~0.2 s of hashing runs on
    another thread, this thread's Python loop keeps turning; holding the GIL, its
    longest pause was the kernel's whole run."""
    import threading
    import time

    from data.hash_kernels import hash_strings

    kernel = hash_strings()
    if kernel is None:
        pytest.skip("numba is not installed")
    data = np.frombuffer(np.random.default_rng(0).bytes(160_000_000), dtype=np.uint8)
    offsets = np.arange(0, data.size + 1, 40, dtype=np.int64)
    out = np.empty(offsets.size - 1, dtype=np.uint64)
    kernel(offsets[:3], data, out[:2])  # compiled (or loaded) first
    spans = []

    def hash_all() -> None:
        t0 = time.perf_counter()
        kernel(offsets, data, out)
        spans.append((t0, time.perf_counter()))

    worker = threading.Thread(target=hash_all)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    (start, end), = spans
    inside = [t for t in ticks if start <= t <= end]
    longest = max(b - a for a, b in zip([start, *inside], [*inside, end], strict=True))
    assert end - start > 0.05, "the kernel ran too briefly to tell"
    assert longest < 0.5 * (end - start), (longest, end - start)
