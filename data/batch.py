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
from data.pinned import pinned_copies


@dataclass
class Batch:
    dense: torch.Tensor
    sparse: JaggedFeatures
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=torch.device(device), non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory: dense and labels in one block, the sparse
        tensors in another (data/pinned.py)."""
        dense, labels = pinned_copies([self.dense, self.labels])
        return Batch(dense=dense, sparse=self.sparse.pin_memory(), labels=labels)

    def select(self, index: torch.Tensor) -> Batch:
        """The samples at ``index`` (int64 [k]), in that order: a micro-batch."""
        return Batch(
            dense=self.dense.index_select(0, index),
            sparse=self.sparse.select(index),
            labels=self.labels.index_select(0, index),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.dense.record_stream(stream)
        self.labels.record_stream(stream)
        self.sparse.record_stream(stream)
