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
