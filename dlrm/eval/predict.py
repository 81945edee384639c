"""Scores of a model over a reader, and the metrics of a whole (all ranks') eval set."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dlrm.eval.metrics import evaluate_predictions
from dlrm.models.interface import RecModel
from dlrm.parallel.distributed import DistInfo, all_gather_rows


@torch.no_grad()
def predict(
    model: RecModel, batches: Iterable, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and labels over ``batches`` (float64 on the CPU, [N]).

    Every batch goes through the model, empty ones too: with several ranks each
    forward is a collective."""
    was_training = model.training
    model.eval()
    scores, labels = [torch.zeros(0, dtype=torch.float64)], [torch.zeros(0, dtype=torch.float64)]
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        scores.append(torch.sigmoid(model(batch.dense, batch.sparse)).double().cpu())
        labels.append(batch.labels.double().cpu())
    model.train(was_training)
    return torch.cat(scores), torch.cat(labels)


def evaluate(
    model: RecModel, reader: Any, info: DistInfo | None = None
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """Metrics of the whole eval set (all ranks' shares gathered), scores, labels."""
    info = info or DistInfo()
    scores, labels = predict(model, reader.epoch(0), info.device)
    scores, labels = all_gather_rows(scores, info), all_gather_rows(labels, info)
    return evaluate_predictions(scores.numpy(), labels.numpy()), scores, labels
