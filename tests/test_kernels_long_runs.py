"""Long runs in the Triton backward (embeddings/kernels/sparse_update.py): a hot id's
lookups are summed in segments of SEGMENT from the run's head, in a fixed order.

Reference: the same order written in plain torch (float32 adds, one lookup at a time:
each segment from zero, then the segments in turn), compared bit for bit; and the
dense autograd gradient through ``embedding_bag``, compared within rounding.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from embeddings.kernels.reference import pooled_reference
from embeddings.kernels.sparse_update import SEGMENT, backward_kv, backward_update
from embeddings.optim import make_sparse_optimizer

BATCH, DIM = 200, 8
# run lengths per row of each feature's table: one run far longer than a segment, and
# runs at and around the segment's length (31 .. 65 for SEGMENT 32)
RUNS = ((150, 33, 17), (64, 32, 65, 39))


def single_hot_ids(runs: tuple[int, ...], seed: int) -> torch.Tensor:
    """[BATCH] ids, row r repeated runs[r] times, in a shuffled order."""
    ids = torch.cat([torch.full((n,), row) for row, n in enumerate(runs)])
    return ids[torch.randperm(BATCH, generator=torch.Generator().manual_seed(seed))]


def features(which: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(values, offsets, row_base, stacked rows) of the features ``which``, stacked in
    that order, single-hot, feature-major."""
    values = torch.cat([single_hot_ids(RUNS[f], seed=f) for f in which])
    offsets = torch.arange(values.numel() + 1)
    sizes = [len(RUNS[f]) for f in which]
    row_base = torch.tensor([sum(sizes[:k]) for k in range(len(which))])
    return values.to(DEVICE), offsets.to(DEVICE), row_base.to(DEVICE), sum(sizes)


def segmented_sums(values: torch.Tensor, row_base: torch.Tensor, grad: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each stacked row's gradient: its lookups in lookup order, SEGMENT at a time
    from zero, the segments added in turn (sample-major ``grad`` [B, F*D])."""
    lookups: dict[int, list[torch.Tensor]] = {}
    for j, local in enumerate(values.tolist()):
        f, b = divmod(j, BATCH)
        lookups.setdefault(int(row_base[f]) + local, []).append(grad[b, f * DIM:(f + 1) * DIM])
    sums = {}
    for row, rows in lookups.items():
        segments = []
        for start in range(0, len(rows), SEGMENT):
            acc = torch.zeros(DIM, dtype=torch.float32)
            for g in rows[start:start + SEGMENT]:
                acc = acc + g
            segments.append(acc)
        total = segments[0]
        for later in segments[1:]:
            total = total + later
        sums[row] = total
    return sums


def test_long_runs_sum_in_segments_from_their_head() -> None:
    values, offsets, row_base, rows = features((0, 1))
    grad = torch.randn(BATCH, 2 * DIM, generator=torch.Generator().manual_seed(5))
    got = backward_kv(grad.to(DEVICE), values, offsets, row_base, BATCH, False, False)
    want = segmented_sums(values.cpu(), row_base.cpu(), grad)
    assert got.ids.tolist() == sorted(want)
    for row, summed in zip(got.ids.tolist(), got.rows.cpu(), strict=True):
        assert torch.equal(summed, want[row]), row
    # and the gradient itself: dense autograd through the pooled lookup
    weight = torch.randn(rows, DIM, device=DEVICE, requires_grad=True)
    pooled = pooled_reference(weight, values, offsets, row_base, BATCH, False, False)
    (pooled * grad.to(DEVICE)).sum().backward()
    torch.testing.assert_close(got.rows, weight.grad[got.ids], rtol=1e-5, atol=1e-5)


def test_a_run_sums_the_same_wherever_it_sits_in_the_sort() -> None:
    """Feature 1 alone, and stacked after feature 0 (its lookups then sort 200
    positions later): its rows' gradients are equal bit for bit."""
    grad = torch.randn(BATCH, 2 * DIM, generator=torch.Generator().manual_seed(6))
    values, offsets, row_base, _ = features((0, 1))
    stacked = backward_kv(grad.to(DEVICE), values, offsets, row_base, BATCH, False, False)
    values1, offsets1, base1, _ = features((1,))
    alone = backward_kv(grad[:, DIM:].contiguous().to(DEVICE), values1, offsets1, base1, BATCH, False, False)
    first = len(RUNS[0])
    assert torch.equal(stacked.ids[first:] - first, alone.ids)
    assert torch.equal(stacked.rows[first:], alone.rows)


@pytest.mark.parametrize("mean", [False, True])
def test_fused_sgd_update_of_long_runs(mean: bool) -> None:
    """The fused update applies the same sums: SGD's row = weight - lr * gradient."""
    values, offsets, row_base, rows = features((0, 1))
    grad = torch.randn(BATCH, 2 * DIM, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    weight = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    kv = backward_kv(grad, values, offsets, row_base, BATCH, mean, False)
    updated = weight.clone()
    lr = torch.tensor([0.5], device=DEVICE)
    backward_update(grad, values, offsets, row_base, BATCH, mean, False, updated, make_sparse_optimizer("sgd"),
                    {}, lr)
    torch.testing.assert_close(updated[kv.ids], weight[kv.ids] - 0.5 * kv.rows, rtol=0, atol=1e-6)


@pytest.mark.skipif(SEGMENT != 32, reason="the run below sets its own segment")
def test_runs_of_more_partials_than_a_load_takes() -> None:
    """A run's later segments' partials are loaded SEGMENT at a time: the runs here
    (150 lookups) have 4 partials at the default segment, so the tests above load them
    once. At a segment of 2 (DLRM_KERNEL_RUN_SEGMENT, read at import: a fresh process)
    a 150-lookup run has 74 partials, loaded 2 at a time in 37 rounds, and the same
    bit-for-bit tests must hold."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DLRM_KERNEL_RUN_SEGMENT": "2", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           f"{Path(__file__).relative_to(root)}", "-k", "not more_partials"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "4 passed" in proc.stdout, proc.stdout[-2000:]
