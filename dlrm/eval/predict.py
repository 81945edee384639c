"""Scores of a model over a reader, and the metrics of a whole (all ranks') eval set."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dlrm.eval.metrics import evaluate_predictions
from dlrm.models.interface import RecModel
from dlrm.parallel.distributed import DistInfo, all_gather_rows, all_reduce_sum


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
    result = evaluate_predictions(scores.numpy(), labels.numpy())
    if getattr(reader, "id_policy", None) == "drop":
        result["unseen_ids"] = unseen_counts(reader, info)
    return result, scores, labels


def unseen_counts(reader: Any, info: DistInfo) -> dict[str, int]:
    """Ids past their trained table, looked up as nothing, by column (every rank's)."""
    names = reader.schema.sparse_names
    counts = all_reduce_sum([float(reader.unseen_ids.get(n, 0)) for n in names], info)
    return {n: int(c) for n, c in zip(names, counts, strict=True) if c}
