"""One training step of the CUDA code path, audited on the CPU.

The native engine with ``embeddings.kernels=triton`` (Triton's interpreter stands in
for the GPU), configs/bench.yaml's model at batch 256, SGD: the trainer's whole step
(forward, loss, backward, fused sparse update, dense update) runs inside
``tests/sync_audit.SyncAudit``, which fails on any op whose output shape depends on
data and on any read of a device value by the host, and counts the ops issued.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")

from data.generate import generate_dataset
from dlrm.config import load_config
from dlrm.train import trainer as trainer_module
from tests.conftest import REPO
from tests.sync_audit import SyncAudit

pytestmark = pytest.mark.kernels
SHAPE = ["generate.rows=2048", "generate.table_rows=[5000]", "generate.row_group_rows=1024",
         "data.batch_size=256", "train.max_steps=2", "train.log_every=0", "train.eval_every=0",
         "train.checkpoint_every=0", "train.progress=false", "data.eval="]


def audited_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str) -> SyncAudit:
    """Train 2 steps; the audit of the second (steady state: lr and Adam's step are on
    the device since the first, the reader's threads are running)."""
    data = tmp_path / "data"
    cfg = load_config(REPO / "configs" / "bench.yaml", [*SHAPE, f"data.train={data}",
                                                        f"embeddings.kernels={kernels}"])
    if not data.exists():
        generate_dataset(str(data), cfg.generate, seed=0)
    audits: list[SyncAudit] = []
    step = trainer_module.Trainer.step

    def audited(self, batches):
        if self.progress.global_step != 1:
            return step(self, batches)
        with SyncAudit() as audit:
            done = step(self, batches)
        audits.append(audit)
        return done

    monkeypatch.setattr(trainer_module.Trainer, "step", audited)
    trainer_module.train(cfg, tmp_path / f"run_{kernels}", echo=lambda s: None)
    return audits[0]


@pytest.mark.slow
def test_training_step_on_the_cuda_path_never_waits_for_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" or DEVICE.type == "cuda"
    triton = audited_step(tmp_path, monkeypatch, "triton")
    torch_path = audited_step(tmp_path, monkeypatch, "torch")
    print(f"ops per step: triton path {triton.compute_ops} (no sync), torch path "
          f"{torch_path.compute_ops} (syncs: {sorted(set(torch_path.violations))})")
    assert triton.violations == []
    assert triton.ops["triton._pooled_kernel"] == 1 and triton.ops["triton._runs_kernel"] == 1
    assert "aten.unique_consecutive" in torch_path.violations  # what the kernels removed
    assert triton.compute_ops < torch_path.compute_ops
