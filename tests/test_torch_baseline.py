"""The bench's stock-PyTorch row (embeddings.backend=torch_baseline): its forward is
torch's embedding_bag and the shared MLPs, it learns generated data through the same
trainer and reader as every engine, and dlrm bench reports its row with its tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlrm.cli import main
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides

SMALL = ["generate.rows=20000", "generate.row_group_rows=4096"]


def test_forward_is_embedding_bag_and_the_dense_arch() -> None:
    from data.jagged import JaggedFeatures
    from dlrm.models.torch_baseline import TorchBaselineDLRM
    from embeddings.table import TableSpec

    cfg = load_config(TINY, [])
    tables = [TableSpec("t0", 50, cfg.model.embedding_dim, ("a", "b")),
              TableSpec("t1", 7, cfg.model.embedding_dim, ("c",))]
    model = TorchBaselineDLRM(3, tables, cfg.model, cfg.optim, 0, torch.device("cpu"))
    lengths = torch.tensor([1, 2, 0, 1, 1, 3], dtype=torch.int64)  # 3 features x B=2
    values = torch.tensor([4, 9, 49, 0, 1, 2, 6, 5])
    sparse = JaggedFeatures(["a", "b", "c"], values, lengths, stride=2)
    dense = torch.randn(2, 3)
    w0, w1 = model.bags[0].weight, model.bags[1].weight
    pooled = torch.cat([
        torch.stack([w0[4], w0[9] + w0[49]]), torch.stack([torch.zeros_like(w0[0]), w0[0]]),
        torch.stack([w1[1], w1[2] + w1[6] + w1[5]])], dim=1)
    torch.testing.assert_close(model(dense, sparse), model.dense_arch(dense, pooled))
    assert model(dense, sparse).shape == (2,)
    assert all(b.sparse for b in model.bags)  # torch's sparse gradients, as the reference


@pytest.mark.slow
@pytest.mark.parametrize("sparse_opt", ["sgd", "adam"])
def test_it_learns_through_the_trainer(tiny_data, tmp_path: Path, sparse_opt: str) -> None:
    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": tiny_data["eval"]})
                      + ["embeddings.backend=torch_baseline", f"optim.sparse={sparse_opt}"])
    summary = train(cfg, tmp_path, echo=lambda s: None)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) >= 4
    assert sum(losses[-2:]) < sum(losses[:2])  # the loss falls
    assert summary["eval_auc"] > 0.65  # chance is 0.5


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_row_with_its_tables(tmp_path: Path) -> None:
    assert main(["bench", "--config", str(TINY), "--engines", "torch_baseline", "--ranks", "1,2",
                 "--steps", "10", "--out", str(tmp_path), *SMALL]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["engine"], r["ranks"]) for r in rows] == [("torch_baseline", 1)]  # one rank only
    tiny = load_config(TINY, SMALL).generate
    assert rows[0]["tables"] == {"count": tiny.sparse, "rows": tiny.sparse * tiny.table_rows[0],
                                 "bytes": tiny.sparse * tiny.table_rows[0] * 16 * 4, "dtype": "fp32"}
    assert rows[0]["samples_per_s"] > 0
