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
