"""SplitMix64's finaliser: the one fixed 64-bit mixing hash of the data side.

    splitmix64(x) = z ^ (z >> 31), where z runs x + 0x9E3779B97F4A7C15 through two
                    xor-shift-multiply rounds (>> 30, * 0xBF58476D1CE4E5B9; >> 27,
                    * 0x94D049BB133111EB), all modulo 2^64

Used by the reader (``id_policy="hash"``: splitmix64(id) % rows) and by the synthetic
generator (per-table keys and per-id effects). NumPy (strings: numba where installed,
data/hash_kernels.py), so neither pulls in torch.
"""

from __future__ import annotations

import numpy as np

from data.hash_kernels import GOLDEN, MUL1, MUL2, SEED_BYTES, hash_strings


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise: uint64 [n] → uint64 [n] (inputs cast to uint64)."""
    return _mix(x.astype(np.uint64) + GOLDEN)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's rounds on ``z`` (uint64, already offset), in place: no temporaries
    beyond one shift buffer (hashing strings runs this over every byte)."""
    t = np.right_shift(z, np.uint64(30))
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, MUL1, out=z)
    np.right_shift(z, np.uint64(27), out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, MUL2, out=z)
    np.right_shift(z, np.uint64(31), out=t)
    np.bitwise_xor(z, t, out=z)
    return z


def hash_bytes(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """A stable 64-bit hash of each byte string, without a Python loop per string.

    ``offsets`` [n + 1] (int64, into ``data``) and ``data`` (uint8) are an Arrow string
    or binary array's buffers. String i's hash is
    splitmix64(len_i + splitmix64(sum_j splitmix64(256 * j + byte_ij + seed))): every
    byte is mixed with its position, so order matters, and the sum (mod 2^64) is a
    cumulative sum's difference. The same bytes give the same hash on every rank, in
    every run and on every machine (unlike Python's ``hash``, salted per process).
    Compiled where numba is installed (data/hash_kernels.py), else in numpy.
    """
    offsets = offsets.astype(np.int64, copy=False)
    compiled = hash_strings() if len(offsets) > 1 else None
    if compiled is not None:  # one pass, the same bits
        out = np.empty(len(offsets) - 1, dtype=np.uint64)
        compiled(offsets, data, out)
        return out
    lengths = np.diff(offsets)
    # (256 * position within its string + byte + seed + splitmix's offset), built in place
    mixed = np.arange(offsets[-1] - offsets[0], dtype=np.int64)
    mixed -= np.repeat(offsets[:-1] - offsets[0], lengths)
    mixed = mixed.view(np.uint64)
    np.left_shift(mixed, np.uint64(8), out=mixed)
    mixed += data[offsets[0]:offsets[-1]]
    mixed += SEED_BYTES + GOLDEN
    sums = np.zeros(len(mixed) + 1, dtype=np.uint64)
    np.cumsum(_mix(mixed), out=sums[1:])
    ends = offsets - offsets[0]
    per_string = sums[ends[1:]] - sums[ends[:-1]]  # wraps mod 2^64, as the sum does
    return splitmix64(lengths.astype(np.uint64) + splitmix64(per_string))
