"""SplitMix64's finaliser: the one fixed 64-bit mixing hash of the data side.

    splitmix64(x) = z ^ (z >> 31), where z runs x + 0x9E3779B97F4A7C15 through two
                    xor-shift-multiply rounds (>> 30, * 0xBF58476D1CE4E5B9; >> 27,
                    * 0x94D049BB133111EB), all modulo 2^64

Used by the reader (``id_policy="hash"``: splitmix64(id) % rows) and by the synthetic
generator (per-table keys and per-id effects). NumPy only, so neither pulls in torch.
"""

from __future__ import annotations

import numpy as np


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise: uint64 [n] → uint64 [n] (inputs cast to uint64)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_SEED_BYTES = np.uint64(0x2545F4914F6CDD1D)


def hash_bytes(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """A stable 64-bit hash of each byte string, without a Python loop per string.

    ``offsets`` [n + 1] (int64, into ``data``) and ``data`` (uint8) are an Arrow string
    or binary array's buffers. String i's hash is
    splitmix64(len_i + splitmix64(sum_j splitmix64(256 * j + byte_ij + seed))): every
    byte is mixed with its position, so order matters, and the sum (mod 2^64) is a
    cumulative sum's difference. The same bytes give the same hash on every rank, in
    every run and on every machine (unlike Python's ``hash``, salted per process).
    """
    offsets = offsets.astype(np.int64, copy=False)
    lengths = np.diff(offsets)
    body = data[offsets[0]:offsets[-1]].astype(np.uint64)
    pos = np.arange(len(body), dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lengths)
    mixed = splitmix64((pos.astype(np.uint64) << np.uint64(8)) + body + _SEED_BYTES)
    sums = np.zeros(len(body) + 1, dtype=np.uint64)
    np.cumsum(mixed, out=sums[1:])
    ends = offsets - offsets[0]
    per_string = sums[ends[1:]] - sums[ends[:-1]]  # wraps mod 2^64, as the sum does
    return splitmix64(lengths.astype(np.uint64) + splitmix64(per_string))
