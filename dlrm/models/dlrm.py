"""DLRM (Naumov et al., 2019): plain PyTorch that knows nothing of ranks.

    dense [B, n_dense] ─► bottom MLP ─► [B, D] ─┐
    sparse ids ─► embeddings ─► pooled [B, F*D] ─┴─► interaction ─► top MLP ─► logit [B]

The embedding collection is given from outside (single-process, sharded or
Hotline); sharding it and wrapping the MLPs in DDP happen elsewhere.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlrm.config import ModelConfig
from dlrm.models.interaction import CrossInteraction, DotInteraction
from embeddings.interface import HotSetHolder

if TYPE_CHECKING:
    from data.jagged import KeyedJagged
    from embeddings.interface import PooledEmbeddings, Prefetched, TableState
    from embeddings.plan.types import ShardingPlan


def mlp(in_features: int, sizes: list[int], relu_last: bool) -> nn.Sequential:
    """Linear layers of ``sizes``; ReLU after each but (unless relu_last) the last."""
    layers: list[nn.Module] = []
    for i, out_features in enumerate(sizes):
        with warnings.catch_warnings():  # no dense features: the first layer is its bias alone
            warnings.filterwarnings("ignore", "Initializing zero-element tensors", UserWarning)
            layers.append(nn.Linear(in_features, out_features))
        if relu_last or i < len(sizes) - 1:
            layers.append(nn.ReLU(inplace=True))  # no extra [B, width] tensor per layer
        in_features = out_features
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    """Everything dense: bottom MLP, interaction, top MLP. DDP wraps this one module."""

    def __init__(self, num_dense: int, num_sparse: int, dim: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.bottom = mlp(num_dense, cfg.bottom_mlp, relu_last=True)
        if cfg.interaction == "dot":
            self.interaction: nn.Module = DotInteraction(num_sparse, dim)
        else:
            self.interaction = CrossInteraction(num_sparse, dim, cfg.dcn_layers, cfg.dcn_rank)
        self.top = mlp(self.interaction.out_features, cfg.top_mlp, relu_last=False)
        # hotline.graph_dense: the halves captured as CUDA graphs (dlrm/train/dense_graphs.py;
        # a plain attribute, not a submodule: nothing of it is in the state dict)
        self.graphs: Any = None

    def forward(
        self, dense: torch.Tensor, pooled: torch.Tensor | Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """dense [B, n_dense], pooled [B, F*D] → logits [B].

        ``pooled`` may be a function that finishes the embedding lookup: it is called
        after the bottom MLP, which so overlaps the ids all-to-all in flight. Graphed
        (``graphs``): in training, at the captured batch size, the halves replay."""
        if self.graphs is not None and self.training and self.graphs.fits(dense):
            return self.graphs.forward(dense, pooled)
        bottom = self.bottom(dense)
        if callable(pooled):
            pooled = pooled()
        return self.top(self.interaction(bottom, pooled)).squeeze(1)


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (or the module itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


class DLRM(nn.Module):
    """Plain DLRM over any embedding collection (embeddings/interface.py).

    The collection is given from outside; so is DDP around ``dense_arch`` (see
    dlrm/parallel/parallelize.py). ``forward`` is the same for every placement:
    the lookup is started, the bottom MLP runs, then the lookup is finished (a
    sharded collection has its ids all-to-all in flight meanwhile).
    """

    def __init__(self, num_dense: int, embeddings: PooledEmbeddings, cfg: ModelConfig) -> None:
        super().__init__()
        dim = embeddings.dim
        if not cfg.bottom_mlp or cfg.bottom_mlp[-1] != dim:
            raise ValueError(
                f"model.bottom_mlp must end with model.embedding_dim ({dim}), got {cfg.bottom_mlp}"
            )
        if not cfg.top_mlp or cfg.top_mlp[-1] != 1:
            raise ValueError(f"model.top_mlp must end with 1, got {cfg.top_mlp}")
        self.embeddings = embeddings
        self.dense_arch: nn.Module = DenseArch(num_dense, len(embeddings.features), dim, cfg)

    def forward(self, dense: torch.Tensor, sparse: KeyedJagged | Prefetched) -> torch.Tensor:
        """Logits [B]."""
        started = self.embeddings.start(sparse)
        return self.dense_arch(dense, lambda: self.embeddings.finish(started))

    @property
    def plan(self) -> ShardingPlan | None:
        return self.embeddings.plan

    def dense_parameters(self) -> list[nn.Parameter]:
        """MLP and interaction parameters: the dense optimizer's (and DDP's) share."""
        return list(self.dense_arch.parameters())

    def begin_step(self, sparse_lr: float) -> None:
        """Before forward: the learning rate the (possibly fused) sparse update uses."""
        self.embeddings.set_lr(sparse_lr)

    def end_step(self) -> None:
        """After backward: apply kept KV gradients (no-op when fused)."""
        self.embeddings.step()

    def no_sync(self) -> AbstractContextManager:
        """DDP's no_sync on the dense side (nothing to hold back without DDP)."""
        if isinstance(self.dense_arch, DistributedDataParallel):
            return self.dense_arch.no_sync()
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release what the model holds outside itself: nothing (the torchrec backend has a process group)."""

    def export_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """MLP tensors and per-table embedding tensors (weights and optimizer state)."""
        return {"dense": unwrap(self.dense_arch).state_dict(), "tables": self.embeddings.export_tables()}

    def import_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`export_state`; KeyError/ValueError name what does not fit."""
        self._import_dense(state["dense"])
        self.embeddings.import_tables(state["tables"])

    def state_for_checkpoint(self) -> tuple[dict[str, Any], TableState]:
        """The MLPs for state.pt (and a Hotline collection's hot set and refresh
        inputs); the tables to write shard by shard."""
        state: dict[str, Any] = {"dense": unwrap(self.dense_arch).state_dict()}
        if isinstance(self.embeddings, HotSetHolder):
            state["hotline"] = {"hot_ids": self.embeddings.hot_ids_by_group(),
                                "refresh": self.embeddings.refresh_state}
        return state, self.embeddings.table_state()

    def restore(self, state: dict[str, Any], read_tables: Callable[[TableState], None]) -> None:
        """The MLPs, then the tables, then (Hotline) the hot set the run had when it
        saved: a refresh may have replaced the profile's (a checkpoint from before
        the hot set was saved keeps the profile's)."""
        self._import_dense(state["dense"])
        read_tables(self.embeddings.table_state())
        self.embeddings.tables_loaded()
        hotline = state.get("hotline")
        if hotline is not None and isinstance(self.embeddings, HotSetHolder):
            self.embeddings.load_hot_ids(list(hotline["hot_ids"]))
            self.embeddings.refresh_state = hotline["refresh"]

    def _import_dense(self, dense: dict[str, torch.Tensor]) -> None:
        missing, unexpected = unwrap(self.dense_arch).load_state_dict(dense, strict=False)
        if missing or unexpected:
            raise KeyError(f"dense state: missing {missing[:1]}, unexpected {unexpected[:1]}")
