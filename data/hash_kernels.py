"""The string hash of data/hashing.py compiled (numba): one pass over the bytes.

:func:`data.hashing.hash_bytes` in numpy builds, for every byte, its position, its
mixed value and a running sum: about 40 bytes of temporaries per byte, and 5 passes.
Reading Avazu-shaped string columns spent a quarter of its time there. Here each
string is hashed in registers:

    per string i:  s = sum_j mix(256 * j + byte_ij + SEED + G)      (mod 2^64)
                   hash_i = mix(len_i + mix(s + G) + G)             (splitmix64 twice)

the same bits as the numpy recipe for every input (tests/test_hashing.py compares
them). numba is an ordinary dependency (the GPU machine's image has it too); without
it :func:`hash_strings` is None and data/hashing.py keeps the numpy recipe. numba is
imported at the first string hashed, not with this module (a process that reads no
strings never pays its import), and the kernel is cached on disk (``cache=True``): a
process after the first loads it (about 0.1 s) instead of compiling it (about 1 s).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np

# splitmix64's increment and multipliers, and the strings' seed: data/hashing.py's too
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MUL1 = np.uint64(0xBF58476D1CE4E5B9)
MUL2 = np.uint64(0x94D049BB133111EB)
SEED_BYTES = np.uint64(0x2545F4914F6CDD1D)


def _hash_strings(offsets: np.ndarray, data: np.ndarray, out: np.ndarray) -> None:
    """out[i] := the hash of bytes data[offsets[i]:offsets[i + 1]] (uint64)."""
    for i in range(out.shape[0]):
        start, end = offsets[i], offsets[i + 1]
        total = np.uint64(0)
        for j in range(start, end):
            total += _mix((np.uint64(j - start) << np.uint64(8)) + np.uint64(data[j]) + SEED_BYTES + GOLDEN)
        out[i] = _mix(np.uint64(end - start) + _mix(total + GOLDEN) + GOLDEN)


def _mix_py(z: np.uint64) -> np.uint64:  # splitmix64's rounds (wrapping uint64)
    z = (z ^ (z >> np.uint64(30))) * MUL1
    z = (z ^ (z >> np.uint64(27))) * MUL2
    return z ^ (z >> np.uint64(31))


@cache
def hash_strings() -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
    """The compiled ``_hash_strings``, or None without numba."""
    try:
        import numba
    except ImportError:
        return None
    global _mix  # the kernel calls _mix: compiled too, inlined
    _mix = numba.njit(inline="always")(_mix_py)
    # nogil: arrays in, arrays out; the decode thread hashes while the trainer runs Python
    return numba.njit(cache=True, nogil=True)(_hash_strings)


_mix = _mix_py
