"""The two-tier lookup (embeddings/kernels/two_tier.py) against plain torch.

Reference: both tiers as one table, [hot rows; staged cold rows], through
``embedding_bag`` (forward) and dense autograd (backward): the hot rows' fused
update (SGD, row-wise Adagrad, Adam) and the cold rows' gradient, by cold row, from
one pass of the update's kernels over both tiers' keys, must equal the dense
gradient's rows of each tier.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from embeddings.kernels.reference import pooled_reference, two_tier_reference
from embeddings.kernels.sparse_update import backward_update
from embeddings.kernels.two_tier import tier_ids, two_tier_forward, two_tier_lookup
from embeddings.kv import KVGradient
from embeddings.optim import make_sparse_optimizer

FEATURES, BATCH, DIM = 3, 6, 5
HOT, STAGED, CAPACITY = 4, 5, 9  # hot rows; cold rows staged (U); the cold buffer's rows


def case(multi_hot: bool, seed: int, dtype: torch.dtype = torch.float32, batch: int = BATCH, dim: int = DIM):
    """(hot [H, D], cold [C, D] first U staged, is_hot, slot, cold_local, offsets): each
    lookup hot with p 0.6; every staged cold row used by at least one lookup."""
    gen = torch.Generator().manual_seed(seed)
    bags = FEATURES * batch
    lengths = torch.randint(0, 4, (bags,), generator=gen) if multi_hot else torch.ones(bags, dtype=torch.int64)
    if multi_hot:
        lengths[2] = 0
    n = int(lengths.sum())
    is_hot = torch.rand(n, generator=gen) < 0.6
    is_hot[:STAGED] = False  # cold lookups enough to use every staged row
    slot = torch.randint(0, HOT, (n,), generator=gen)
    cold_local = torch.randint(0, STAGED, (n,), generator=gen)
    cold_local[:STAGED] = torch.arange(STAGED)
    slot[~is_hot] = 10_000  # meaningless where cold: never read
    cold_local[is_hot] = 10_000  # meaningless where hot
    offsets = torch.zeros(bags + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    hot = torch.randn(HOT, dim, generator=gen).to(dtype)
    cold = torch.randn(CAPACITY, dim, generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (hot, cold, is_hot, slot, cold_local, offsets)]


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [BATCH, 200])  # 600 bags: several programs, the last part-filled
# 64 and 100 (a masked 128-wide tile): the widths runs use, their own tiles and bags a program
@pytest.mark.parametrize("dim", [DIM, 64, 100])
def test_two_tier_forward_equals_one_table(mean: bool, multi_hot: bool, dtype: torch.dtype, batch: int,
                                           dim: int) -> None:
    hot, cold, is_hot, slot, cold_local, offsets = case(multi_hot, seed=1, dtype=dtype, batch=batch, dim=dim)
    got = two_tier_forward(hot, cold, is_hot, slot, cold_local, offsets, FEATURES, batch, mean)
    safe_slot, safe_local = slot.clamp(max=HOT - 1), cold_local.clamp(max=CAPACITY - 1)
    want = two_tier_reference(hot, cold, is_hot, safe_slot, safe_local, offsets, FEATURES, batch, mean)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("optim", ["sgd", "rowwise_adagrad", "adam"])
def test_two_tier_backward_updates_hot_rows_and_returns_cold_rows(mean: bool, multi_hot: bool, optim: str) -> None:
    """The hot rows updated in the kernel, the cold rows' gradient by cold row, in one
    pass: each the dense autograd gradient of its tier's rows in the one-table
    reference (the hot rows through the optimizer's torch path on that gradient)."""
    hot, cold, is_hot, slot, cold_local, offsets = case(multi_hot, seed=2)
    lr = 0.5
    grad_out = torch.randn(BATCH, FEATURES * DIM, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    table = torch.cat([hot, cold]).requires_grad_(True)
    ids = torch.where(is_hot, slot.clamp(max=HOT - 1), HOT + cold_local.clamp(max=CAPACITY - 1))
    zeros = torch.zeros(FEATURES, dtype=torch.int64, device=DEVICE)
    (pooled_reference(table, ids, offsets, zeros, BATCH, mean) * grad_out).sum().backward()
    dense_grad = table.grad

    optimizer = make_sparse_optimizer(optim)
    want, want_state = hot.clone(), optimizer.init_state(HOT, DIM, DEVICE)
    rows = slot[is_hot].unique()  # the hot rows looked up (a KV gradient: those rows only)
    optimizer.apply(want, want_state, KVGradient(rows, dense_grad[:HOT].index_select(0, rows)), lr)

    weight = hot.clone().requires_grad_(True)
    # per-table scalars (Adam's step) are made on the CPU; the kernel counts them on the
    # weight's device, as the hot tier moves them (a GPU refused the CPU pointer)
    state = {name: t.to(DEVICE) for name, t in optimizer.init_state(HOT, DIM, DEVICE).items()}
    cold_grad = torch.full((CAPACITY, DIM), float('nan'), device=DEVICE)
    lr_t = torch.full((1,), lr, device=DEVICE)

    def on_backward(grad: torch.Tensor) -> None:
        keys = tier_ids(is_hot, slot, cold_local, HOT)
        backward_update(grad, keys, offsets, zeros, BATCH, mean, False, weight.data, optimizer, state, lr_t,
                        rows_by_id=(HOT, cold_grad))

    pooled = two_tier_lookup(weight, cold, is_hot, slot, cold_local, offsets, FEATURES, BATCH, mean, on_backward)
    (pooled * grad_out).sum().backward()
    torch.testing.assert_close(weight.data, want, rtol=1e-5, atol=1e-6)
    for name, value in want_state.items():
        torch.testing.assert_close(state[name].cpu(), value.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cold_grad[:STAGED], dense_grad[HOT:HOT + STAGED], rtol=1e-5, atol=1e-6)
    assert cold_grad[STAGED:].isnan().all()  # rows past U: never written
    assert weight.grad is None  # the update is the kernel's: no dense gradient of the hot rows


def test_tier_ids_put_the_cold_rows_after_the_hot_ones() -> None:
    is_hot = torch.tensor([True, False, True, False])
    slot, cold_local = torch.tensor([3, 99, 1, 99]), torch.tensor([99, 0, 99, 2])
    assert tier_ids(is_hot, slot, cold_local, 4).tolist() == [3, 4, 1, 6]
