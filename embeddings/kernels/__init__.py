"""Triton kernels for the embedding path on CUDA (one module per kernel family).

    pooled.py         forward: every (feature, sample) bag of a batch in one launch
    sparse_update.py  backward: one sort of the stacked ids, then one program per run
                      of equal ids that sums its gradient rows and applies the
                      sparse optimizer in place (or writes the KV gradient)
    lookup.py         the autograd glue the collections call
    reference.py      the same computations in plain torch, for the tests

``embeddings.kernels`` chooses the path: ``auto`` (Triton on CUDA tensors when triton
imports, torch elsewhere), ``triton`` (Triton everywhere: on CPU tensors it needs
``TRITON_INTERPRET=1``, which is how CI runs these kernels), ``torch``.
"""

from __future__ import annotations

import functools
import importlib.util
from enum import Enum

import torch


class KernelChoice(str, Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(choice: str | KernelChoice, device: torch.device) -> bool:
    """Whether tables on ``device`` take the Triton path under ``choice``."""
    choice = KernelChoice(choice)
    if choice is KernelChoice.TORCH:
        return False
    if choice is KernelChoice.TRITON:
        if not triton_available():
            raise RuntimeError("embeddings.kernels=triton needs the triton package")
        return True
    return torch.device(device).type == "cuda" and triton_available()
