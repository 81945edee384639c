"""The staged cold rows' update (embeddings/hotline/cold_stage.py, ``HotTier.update_staged``)
with fp16 tables: the values its stochastic rounding made inf are counted at their
table's first feature, where the hot tier's overflow warning reads them, as the host
tier would have counted them applying the gradient itself."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from embeddings.hotline.hot_tier import HotTier
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec

DIM = 4
# stacked: A rows 0-9 (feature fa), B rows 10-15 (features fb1, fb2)
TABLES = [TableSpec("A", 10, DIM, ("fa",), dtype="fp16"), TableSpec("B", 6, DIM, ("fb1", "fb2"), dtype="fp16")]


def test_fp16_staged_rows_count_their_overflow_at_their_table(capsys: pytest.CaptureFixture[str]) -> None:
    optimizer = make_sparse_optimizer("sgd")
    optimizer.rounding = True  # half tables: both tiers count their updates
    hot = HotTier(optimizer, fused=False, tables=TABLES, kernels="triton")
    hot.load(torch.tensor([0, 12], device=DEVICE), torch.zeros(2, DIM, dtype=torch.float16, device=DEVICE),
             optimizer.init_state(2, DIM, DEVICE))
    hot.set_lr(1.0)
    stage = hot.cold_stage(5, DIM)
    stage.load(torch.tensor([3, 11, 14], device=DEVICE), None)  # A's row 3, B's rows 1 and 4
    rows = torch.full((5, DIM), 60000.0, dtype=torch.float16, device=DEVICE)
    grad = torch.zeros(5, DIM, device=DEVICE)
    grad[0] = 1.0  # 59999: rounded to a neighbour, finite
    grad[1, :3] = -10000.0  # 70000 in three columns: past fp16's 65504, inf
    grad[3] = -10000.0  # past the staged count (3): not applied, not counted
    hot.update_staged(stage, rows, grad)

    assert torch.isinf(rows[1, :3]).all() and rows[1, 3] == 60000.0
    assert rows[0].float().sub(59999.0).abs().max() <= 32  # fp16's spacing at 60000
    assert (rows[2:] == 60000.0).all()  # row 2's gradient is zero; rows 3, 4 past the count
    assert hot._overflow_counts.tolist() == [0, 3, 0]  # B's 3 values, at its first feature (fb1)
    hot.warn_fp16_overflow()
    said = capsys.readouterr()
    lines = [line for line in (said.err + said.out).splitlines() if "fp16" in line]
    assert len(lines) == 1 and "B" in lines[0] and "'A'" not in lines[0], lines
