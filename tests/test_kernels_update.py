"""The Triton backward (embeddings/kernels/sparse_update.py) against a dense autograd
gradient and the torch optimizers of embeddings/optim.py, step after step."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernel_cases import DEVICE, STACKED_ROWS, make_case

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from embeddings.kernels.reference import pooled_reference
from embeddings.kernels.sparse_update import backward_kv, backward_update
from embeddings.kv import KVGradient
from embeddings.optim import make_sparse_optimizer

OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]


def dense_gradient(case, grad_pooled: torch.Tensor, mean: bool, feature_major: bool) -> KVGradient:
    """d(sum(pooled * grad_pooled))/d weight by autograd through embedding_bag, as a
    KV gradient of the rows the batch touched (every looked-up id, gradient or not)."""
    weight = case.weight.detach().clone().requires_grad_(True)
    pooled = pooled_reference(weight, case.values, case.offsets, case.row_base, case.batch, mean,
                              feature_major)
    (pooled * grad_pooled).sum().backward()
    lengths = case.offsets[1:] - case.offsets[:-1]
    bag_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=DEVICE), lengths)
    touched = torch.unique(case.values + case.row_base[bag_of // case.batch])
    return KVGradient(touched, weight.grad[touched])


@pytest.mark.parametrize("feature_major", [False, True])
@pytest.mark.parametrize("dim", [8, 12])
@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("mean", [False, True])
def test_kv_gradient_equals_autograd(feature_major: bool, dim: int, multi_hot: bool, mean: bool) -> None:
    case = make_case(dim, multi_hot, seed=1)
    shape = (3, case.batch, dim) if feature_major else (case.batch, 3 * dim)
    grad_pooled = torch.randn(shape, device=DEVICE)
    got = backward_kv(grad_pooled, case.values, case.offsets, case.row_base, case.batch, mean,
                      feature_major)
    want = dense_gradient(case, grad_pooled, mean, feature_major)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.rows, want.rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("multi_hot", [False, True])
def test_kv_gradient_of_many_bags_equals_autograd(multi_hot: bool) -> None:
    """600 bags: several programs of the linearize kernel (BAGS a program), each with
    its own longest bag, the last one part-filled."""
    case = make_case(8, multi_hot, seed=4, batch=200)
    grad_pooled = torch.randn(case.batch, 3 * 8, device=DEVICE)
    got = backward_kv(grad_pooled, case.values, case.offsets, case.row_base, case.batch, False, False)
    want = dense_gradient(case, grad_pooled, False, False)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.rows, want.rows, rtol=1e-5, atol=1e-5)


# the widths runs use (64: bench_gpu; 100: a masked 128-wide tile, criteo_1tb's 128),
# multi-hot sums, every optimizer: their tiles compile too (tests/test_kernels_compile.py)
WIDE = [(optimizer, dim, True, False) for optimizer in OPTIMIZERS for dim in (64, 100)]


@pytest.mark.parametrize("optimizer,dim,multi_hot,mean",
                         [(o, d, h, m) for o in OPTIMIZERS for d in (8, 12) for h in (False, True)
                          for m in (False, True)] + WIDE)
def test_fused_update_equals_reference_optimizer(optimizer: str, dim: int, multi_hot: bool, mean: bool) -> None:
    """Three steps, different batches: weight and every state tensor follow the torch
    optimizer applied to the autograd gradient; untouched rows never move."""
    rule = make_sparse_optimizer(optimizer, eps=0.1)  # large enough that eps misplaced shows
    weight = make_case(dim, multi_hot).weight.clone()
    state = {k: v.to(DEVICE) for k, v in rule.init_state(STACKED_ROWS, dim, DEVICE).items()}
    ref_weight, ref_state = weight.clone(), {k: v.clone() for k, v in state.items()}
    ref_rule = copy.deepcopy(rule)
    lr = torch.full((1,), 0.05, device=DEVICE)
    touched_ever = torch.zeros(STACKED_ROWS, dtype=torch.bool, device=DEVICE)
    for step in range(3):
        case = make_case(dim, multi_hot, seed=10 + step)
        case.weight = weight
        grad_pooled = torch.randn(case.batch, 3 * dim, device=DEVICE)
        backward_update(grad_pooled, case.values, case.offsets, case.row_base, case.batch, mean,
                        False, weight, rule, state, lr)
        case.weight = ref_weight
        kv = dense_gradient(case, grad_pooled, mean, False)
        ref_rule.apply(ref_weight, ref_state, kv, 0.05)
        touched_ever[kv.ids] = True
        torch.testing.assert_close(weight, ref_weight, rtol=1e-5, atol=1e-6)
        for name, tensor in state.items():
            torch.testing.assert_close(tensor.to(ref_state[name].device), ref_state[name],
                                       rtol=1e-5, atol=1e-6)
    untouched = ~touched_ever
    assert torch.equal(weight[untouched], make_case(dim, multi_hot).weight[untouched])
