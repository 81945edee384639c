"""One mini-batch as training consumes it.

    dense   [B, n_dense] float32
    sparse  JaggedFeatures (data/jagged.py), keys = sparse feature names, feature-major:
            values = [f0 ids of sample 0..B-1 | f1 ids of sample 0..B-1 | ...]
            lengths [F * B] (lengths[f * B + b] = ids of feature f in sample b)
    labels  [B] float32 in [0, 1]

Modelled on TorchRec's ``Batch`` (torchrec/datasets/utils.py): device moves and
pinning are explicit and cheap so that pipelining stays visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data.jagged import JaggedFeatures
from data.pinned import one_block, pinned_copies, record_once, to_device


@dataclass
class Batch:
    dense: torch.Tensor
    sparse: JaggedFeatures
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on ``device``. A GPU from the host: every tensor in one copy of one
        block (data/pinned.py ``to_device``: ``non_blocking``, pinned first where they
        are not in one pinned block), the device tensors views of one block."""
        device = torch.device(device)
        if device.type == "cuda" and self.dense.device.type == "cpu":
            return self._with(to_device(self._tensors(), device, non_blocking))
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory, every tensor in one block (data/pinned.py;
        ``to`` a GPU then copies it once)."""
        tensors = self._tensors()
        block = one_block(tensors)
        if block is not None and block[0].is_pinned():  # the reader's: one check, not one per tensor
            return self
        return self._with(pinned_copies(tensors))

    def _tensors(self) -> list[torch.Tensor]:
        """Dense, labels, ids, lengths, and the ids' offsets where made (``_with``'s order)."""
        return [self.dense, self.labels, *self.sparse.tensors()]

    def _with(self, tensors: list[torch.Tensor]) -> Batch:
        """This batch of ``tensors`` (``_tensors``' order, moved or copied)."""
        dense, labels, values, lengths, *offsets = tensors
        sparse = self.sparse
        return Batch(dense, JaggedFeatures(sparse.keys(), values, lengths, sparse.stride(),
                                           offsets[0] if offsets else None), labels)

    def select(self, index: torch.Tensor) -> Batch:
        """The samples at ``index`` (int64 [k]), in that order: a micro-batch."""
        return Batch(
            dense=self.dense.index_select(0, index),
            sparse=self.sparse.select(index),
            labels=self.labels.index_select(0, index),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Keep the tensors' memory alive until ``stream``'s queued work is done: once
        per storage (a batch moved as one block: one call)."""
        record_once(self._tensors(), stream)
