"""The stock-PyTorch DLRM the bench compares against (``embeddings.backend=torch_baseline``).

    sparse ids ─► one nn.EmbeddingBag(mode="sum", sparse=True) per table ─► pooled [B, F*D]
    dense ─► the same DenseArch (bottom MLP, interaction, top MLP) as ``DLRM``

Trained as facebookresearch/dlrm's dlrm_s_pytorch.py trains it: backward leaves a
sparse gradient on each bag's weight, a stock torch optimizer applies it after
backward. ``optim.sparse`` maps to torch.optim: sgd → SGD, adam → SparseAdam,
adagrad and rowwise_adagrad → Adagrad (torch has no row-wise Adagrad; the
reference's own row-wise variant is not in torch). Weights start as the reference
starts them: uniform(±sqrt(1/rows)). One process only: this is the floor of plain
PyTorch on one device, not a sharded engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dlrm.config import ModelConfig, OptimConfig
from dlrm.models.dlrm import DenseArch

if TYPE_CHECKING:
    from data.jagged import KeyedJagged
    from embeddings.table import TableSpec


class TorchBaselineDLRM(nn.Module):
    """DLRM of nn.EmbeddingBag tables; the trainer sees the same calls as for ``DLRM``."""

    plan = None  # every table in this process

    def __init__(self, num_dense: int, tables: list[TableSpec], model: ModelConfig,
                 optim: OptimConfig, seed: int, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tables = tables
        self.features = [f for t in tables for f in t.features]
        self.table_of = [i for i, t in enumerate(tables) for _ in t.features]
        dim = model.embedding_dim
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(t.rows, dim, mode="sum", sparse=True, device=device) for t in tables
        )
        with torch.no_grad():
            for bag, t in zip(self.bags, tables):
                bound = (1.0 / t.rows) ** 0.5
                bag.weight.uniform_(-bound, bound)
        self.dense_arch = DenseArch(num_dense, len(self.features), dim, model).to(device)
        self.sparse_opt = sparse_torch_optimizer(optim, list(self.bags.parameters()))

    def forward(self, dense: torch.Tensor, sparse: KeyedJagged) -> torch.Tensor:
        """Logits [B]: each feature's bags pooled by its table's EmbeddingBag."""
        parts = sparse.to_dict()
        pooled = []
        for feature, table in zip(self.features, self.table_of):
            jagged = parts[feature]
            pooled.append(self.bags[table](jagged.values(), jagged.offsets()[:-1]))
        return self.dense_arch(dense, torch.cat(pooled, dim=1))

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.dense_arch.parameters())

    def begin_step(self, sparse_lr: float) -> None:
        """The scheduled sparse lr, set on the torch optimizer's group."""
        for group in self.sparse_opt.param_groups:
            group["lr"] = sparse_lr

    def end_step(self) -> None:
        """The sparse update: torch's optimizer over the bags' sparse gradients."""
        self.sparse_opt.step()
        self.sparse_opt.zero_grad(set_to_none=True)

    def no_sync(self) -> AbstractContextManager:
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing held outside the module."""

    def state_for_checkpoint(self) -> tuple[dict[str, Any], None]:
        """Everything in state.pt: weights and the sparse optimizer's state."""
        return {"model": self.state_dict(), "sparse_opt": self.sparse_opt.state_dict()}, None

    def restore(self, state: dict[str, Any], read_tables: Callable[[Any], None]) -> None:
        missing, unexpected = self.load_state_dict(state["model"], strict=False)
        if missing or unexpected:
            raise KeyError(f"torch_baseline state: missing {missing[:1]}, unexpected {unexpected[:1]}")
        self.sparse_opt.load_state_dict(state["sparse_opt"])


def sparse_torch_optimizer(optim: OptimConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """torch.optim's optimizer for ``optim.sparse`` that takes sparse gradients."""
    lr = optim.sparse_lr
    if optim.sparse == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if optim.sparse == "adam":
        return torch.optim.SparseAdam(params, lr=lr, eps=optim.eps)
    return torch.optim.Adagrad(params, lr=lr, eps=optim.eps)
