"""Model quality: with default settings our held-out AUC is within 0.005 of
TorchRec's own DLRM trained on the same data with the same architecture and
optimizer (generated single- and multi-hot data, and the real Criteo sample)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import SHARED_CRITEO, TINY, requires_torchrec, tiny_overrides

pytestmark = [pytest.mark.slow, requires_torchrec]


def train_both(train_path: Path, eval_path: Path, tmp_path: Path, *extra: str) -> dict[str, float]:
    aucs = {}
    for backend in ("native", "torchrec"):
        cfg = load_config(
            TINY,
            tiny_overrides(**{"data.train": train_path, "data.eval": eval_path})
            + [f"embeddings.backend={backend}", *extra],
        )
        aucs[backend] = train(cfg, tmp_path / backend, echo=lambda s: None)["eval_auc"]
    return aucs


def test_generated_data_auc_matches_torchrec(tiny_data, tmp_path: Path) -> None:
    aucs = train_both(tiny_data["train"], tiny_data["eval"], tmp_path)
    print("generated", aucs)
    assert aucs["native"] > 0.70
    assert abs(aucs["native"] - aucs["torchrec"]) < 0.005, aucs


@pytest.mark.skipif(not SHARED_CRITEO.is_dir(), reason="shared Criteo samples absent")
def test_criteo_sample_auc_matches_torchrec(tmp_path: Path) -> None:
    from data.criteo import convert_criteo

    src = SHARED_CRITEO / "criteo_kaggle_train_head10k.tsv"
    (part,) = convert_criteo([str(src)], str(tmp_path / "all"), max_ind_range=20_000)
    table = pq.read_table(part)
    (tmp_path / "train").mkdir()
    (tmp_path / "eval").mkdir()
    pq.write_table(table.slice(0, 8000), tmp_path / "train" / "part.parquet")
    pq.write_table(table.slice(8000), tmp_path / "eval" / "part.parquet")
    # Criteo sample: 8k rows is ~2 epochs of 16 steps at batch 256.
    aucs = train_both(
        tmp_path / "train", tmp_path / "eval", tmp_path, "data.batch_size=256", "train.epochs=2"
    )
    print("criteo", aucs)
    assert aucs["native"] > 0.65
    assert abs(aucs["native"] - aucs["torchrec"]) < 0.005, aucs


def test_bf16_dense_arch_keeps_the_auc(tiny_data, tmp_path: Path) -> None:
    """train.precision=bf16 (MLPs and interaction under autocast) ends within 0.005
    AUC of fp32 training on the same data, and its parameters stay fp32."""
    aucs = {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"],
                                                  "data.eval": tiny_data["eval"]})
                          + [f"train.precision={precision}", "train.precision_fallback=none"])
        aucs[precision] = train(cfg, tmp_path / precision, echo=lambda s: None)["eval_auc"]
    print("precision", aucs)
    assert aucs["bf16"] != aucs["fp32"]  # bf16 really ran
    assert abs(aucs["bf16"] - aucs["fp32"]) < 0.005, aucs
    from tests.run_state import run_state

    assert all(t.dtype != torch.bfloat16 for t in run_state(tmp_path / "bf16").values())
