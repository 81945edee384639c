"""A vocabulary's keys in an open-addressing hash table: each key of a batch found in a
probe or two, compiled (numba).

    slots    capacity = a power of two >= keys / 0.7; key k starts at its Fibonacci
             hash (k * 0x9E3779B97F4A7C15) >> (64 - log2 capacity) and walks on
             (linear probing) to the first slot holding k or empty
    keys     uint64 [capacity]: the vocabulary's keys (an integer, or a string's hash)
    rows     int32  [capacity]: the key's row (its index + 1); 0 = an empty slot

Vocabulary.rows_of_keys used to sort each batch's keys and binary-search the sorted
vocabulary: on one core, Avazu-shaped string columns through their vocabularies spent
a quarter of the reader's time there (py-spy, 2026-11-27; 1.04M rows/s against 1.94M
for int ids). Inserted in row order and never overwritten, a key that two values share
(a hash collision of two strings) keeps its first row, as the binary search found the
first of equal keys. 12 bytes a slot, 17-34 bytes a vocabulary key; built once per
vocabulary and process. Without numba :func:`build` gives None (the binary search
stays).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
MAX_LOAD = 0.7


@dataclass(frozen=True)
class KeyTable:
    keys: np.ndarray  # uint64 [capacity]
    rows: np.ndarray  # int32 [capacity]; 0 = empty
    shift: np.uint64  # 64 - log2(capacity)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Rows [n] (int64) of ``keys`` (int64 or uint64, the vocabulary's kind): the
        row of an equal vocabulary key, else 0."""
        out = np.empty(len(keys), np.int64)
        _kernels()[1](self.keys, self.rows, np.ascontiguousarray(keys).view(np.uint64), self.shift, out)
        return out


def build(keys: np.ndarray) -> KeyTable | None:
    """The table of ``keys`` (key i owns row i + 1), or None without numba."""
    kernels = _kernels()
    if kernels is None or len(keys) >= 2**31 - 1:
        return None
    bits = max(1, int(np.ceil(np.log2(max(len(keys), 1) / MAX_LOAD))))
    table = KeyTable(np.zeros(1 << bits, np.uint64), np.zeros(1 << bits, np.int32), np.uint64(64 - bits))
    kernels[0](table.keys, table.rows, np.ascontiguousarray(keys).view(np.uint64), table.shift)
    return table


def _insert(slot_keys: np.ndarray, slot_rows: np.ndarray, keys: np.ndarray, shift: np.uint64) -> None:
    mask = slot_keys.shape[0] - 1
    for i in range(keys.shape[0]):
        k = keys[i]
        s = np.int64((k * FIBONACCI) >> shift)
        while True:
            if slot_rows[s] == 0:
                slot_keys[s] = k
                slot_rows[s] = i + 1
                break
            if slot_keys[s] == k:  # a key two values share: the first row keeps it
                break
            s = (s + 1) & mask


def _find(slot_keys: np.ndarray, slot_rows: np.ndarray, keys: np.ndarray, shift: np.uint64,
          out: np.ndarray) -> None:
    mask = slot_keys.shape[0] - 1
    for i in range(keys.shape[0]):
        k = keys[i]
        s = np.int64((k * FIBONACCI) >> shift)
        row = 0
        while True:
            r = slot_rows[s]
            if r == 0:
                break
            if slot_keys[s] == k:
                row = r
                break
            s = (s + 1) & mask
        out[i] = row


@cache
def _kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """(insert, find) compiled, or None without numba. nogil: the decode thread looks
    keys up while the trainer runs Python."""
    try:
        import numba
    except ImportError:
        return None
    return (numba.njit(cache=True, nogil=True)(_insert), numba.njit(cache=True, nogil=True)(_find))
