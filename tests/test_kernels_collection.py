"""A LocalEmbeddingCollection on the Triton kernels trains like the torch path."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from data.jagged import JaggedFeatures
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling, TableSpec


def tables(pooling: Pooling, dim: int = 12) -> list[TableSpec]:
    return [TableSpec("t0", rows=7, dim=dim, features=("a", "b"), pooling=pooling),
            TableSpec("t1", rows=5, dim=dim, features=("c",), pooling=pooling)]


def batch(seed: int, multi_hot: bool, keys: tuple[str, ...] = ("c", "a", "b")) -> JaggedFeatures:
    """B=4; by default keys in another order than the collection's features (a, b, c)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (3 * 4,), generator=gen) if multi_hot else torch.ones(12, dtype=torch.long)
    rows = [r for key in keys for r in [5 if key == "c" else 7] * 4]  # each bag's table rows
    values = torch.cat([torch.randint(0, rows[i], (int(n),), generator=gen) for i, n in enumerate(lengths)])
    return JaggedFeatures(list(keys), values, lengths, stride=4).to(DEVICE)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("pooling,multi_hot", [(Pooling.SUM, False), (Pooling.MEAN, True)])
def test_triton_collection_trains_like_torch(fused: bool, optimizer: str, pooling: Pooling,
                                            multi_hot: bool) -> None:
    made = {
        kernels: LocalEmbeddingCollection(tables(pooling), make_sparse_optimizer(optimizer), fused=fused,
                                          seed=3, device=DEVICE, kernels=kernels)
        for kernels in ("triton", "torch")
    }
    assert made["triton"].on_triton() and not made["torch"].on_triton()
    for step in range(3):
        target = torch.randn(4, 36, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        pooled = {}
        for kernels, collection in made.items():
            collection.set_lr(0.1 / (step + 1))  # a schedule: the device copy of lr follows it
            pooled[kernels] = collection(batch(step, multi_hot))
            ((pooled[kernels] - target) ** 2).sum().backward()
            collection.step()
        torch.testing.assert_close(pooled["triton"], pooled["torch"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(made["triton"].weight, made["torch"].weight, rtol=1e-5, atol=1e-5)
    for name, tensor in made["torch"].state.items():
        torch.testing.assert_close(made["triton"].state[name].to(tensor.device), tensor, rtol=1e-5, atol=1e-5)


def test_lookup_feature_major_matches_torch() -> None:
    """``lookup`` ([F, B, D], what the sharded stores call) on both paths."""
    made = [LocalEmbeddingCollection(tables(Pooling.SUM), make_sparse_optimizer("sgd"), seed=1,
                                     device=DEVICE, kernels=k) for k in ("triton", "torch")]
    sparse = batch(0, multi_hot=True)
    values, lengths = sparse.values(), sparse.lengths()
    # feature-major in the collection's order (a, b, c): c's bags come first in the batch
    order = torch.cat([torch.arange(4, 12), torch.arange(0, 4)]).to(DEVICE)
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    ids = torch.cat([values[starts[i]:starts[i] + lengths[i]] for i in order.tolist()])
    got = [c.lookup(ids, lengths[order], 4) for c in made]
    assert got[0].shape == (3, 4, 12)
    torch.testing.assert_close(got[0], got[1], rtol=1e-6, atol=1e-6)


def test_triton_step_has_no_host_sync_and_few_ops() -> None:
    """Forward, backward and fused update of a batch in the collection's own feature
    order (as the reader gives it): no data-dependent shape, no host read; the op
    count is printed beside the torch path's. The audit itself must see a planted sync."""
    from dlrm.train.sync_audit import SyncAudit

    sparse = batch(0, True, keys=("a", "b", "c"))
    counts = {}
    for kernels in ("triton", "torch"):
        collection = LocalEmbeddingCollection(tables(Pooling.SUM), make_sparse_optimizer("adam"), seed=1,
                                              device=DEVICE, kernels=kernels)
        collection.set_lr(0.1)
        collection(sparse).sum().backward()  # the first step moves lr and Adam's step once
        grad = torch.ones(4, 36, device=DEVICE)
        with SyncAudit() as audit:
            collection.set_lr(0.05)
            collection(sparse).backward(grad)
            collection.step()
        counts[kernels] = audit.compute_ops
        if kernels == "triton":
            assert audit.violations == [], audit.violations
            assert audit.ops["triton._pooled_kernel"] == 1 and audit.ops["triton._runs_kernel"] == 1
        else:
            assert audit.violations  # today's torch path: unique_consecutive, .item() of Adam's step
    print(f"embedding step ops: triton {counts['triton']}, torch {counts['torch']}")
    assert counts["triton"] < counts["torch"]
    with SyncAudit() as audit:
        torch.ones(3).sum().item()
    assert audit.violations == ["aten._local_scalar_dense"]


def half_tables(dtype: str, dim: int = 12) -> list[TableSpec]:
    return [TableSpec(t.name, t.rows, t.dim, t.features, t.pooling, dtype=dtype) for t in tables(Pooling.MEAN, dim)]


# D = 64 (bench_gpu's) beside 12: the half paths' 64-wide tiles (compiled by
# tests/test_kernels_compile.py too)
@pytest.mark.parametrize("dim", [12, 64])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_triton_half_tables_train_like_torch(dtype: str, optimizer: str, dim: int) -> None:
    """fp16/bf16 weights on the Triton path: pooled in fp32, updated by the fused kernel
    with the same stochastic rounding as the torch path (same hash coordinates, step
    counted on the device). The fp32 sums may differ in their last bit (a fused
    multiply-add on one side), which moves a rounding with probability ~2^-13; so
    rows agree to one step of the type, and nearly all elements bit for bit."""
    made = {k: LocalEmbeddingCollection(half_tables(dtype, dim), make_sparse_optimizer(optimizer), seed=3,
                                        device=DEVICE, kernels=k, rounding_seed=11)
            for k in ("triton", "torch")}
    assert made["triton"].on_triton() and made["triton"].weight.dtype == made["torch"].weight.dtype
    spacing = 2.0**-7 if dtype == "bf16" else 2.0**-10
    for step in range(4):
        target = torch.randn(4, 3 * dim, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        pooled = {}
        for k, collection in made.items():
            collection.set_lr(1e-3)  # small: updates live in the rounding, not above it
            pooled[k] = collection(batch(step, multi_hot=True))
            ((pooled[k] - target) ** 2).sum().backward()
            collection.step()
        torch.testing.assert_close(pooled["triton"], pooled["torch"], rtol=1e-5, atol=1e-6)
    # both read on the CPU: on a GPU both collections' weights are on it, the fresh one
    # below (the starting weights) is not (the first GPU run failed on the devices alone)
    got, want = made["triton"].weight.detach().float().cpu(), made["torch"].weight.detach().float().cpu()
    torch.testing.assert_close(got, want, rtol=spacing, atol=1e-6)
    assert (got == want).float().mean() > 0.99
    moved = want != LocalEmbeddingCollection(
        half_tables(dtype, dim), make_sparse_optimizer(optimizer), seed=3).weight.float()
    assert moved.any()  # updates below half a spacing moved weights: the rounding is stochastic
    for name in ("rounding_step",):
        assert torch.equal(made["triton"].state[name].cpu(), made["torch"].state[name])


@pytest.mark.parametrize("dim", [12, 64])
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("state_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_triton_half_state_trains_like_torch(weight_dtype: str, state_dtype: str, optimizer: str, dim: int) -> None:
    """Half element-wise state (``embeddings.state_dtype``) in the fused Triton update:
    read in its type, updated in fp32, written back stochastically rounded in its own
    stream (table key xor crc32 of the state's name), as the torch path writes it. In
    the interpreter the state's fp32 arithmetic is the torch path's, so the stored
    state is the same bits; compiled for a GPU the kernel may contract a multiply-add,
    which moves a rounding with probability ~2^-13, so there nearly all bits agree.
    An fp32 weight may differ in its last bit (torch's add with alpha is a fused
    multiply-add on the CPU), a half one is rounded from the same fp32 values."""
    tabs = [TableSpec(t.name, t.rows, t.dim, t.features, t.pooling, dtype=weight_dtype)
            for t in tables(Pooling.MEAN, dim)]
    made = {k: LocalEmbeddingCollection(tabs, make_sparse_optimizer(optimizer, state_dtype=state_dtype), seed=3,
                                        device=DEVICE, kernels=k, rounding_seed=11)
            for k in ("triton", "torch")}
    assert made["triton"].on_triton() and not made["torch"].on_triton()
    for step in range(4):
        target = torch.randn(4, 3 * dim, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        for collection in made.values():
            collection.set_lr(1e-2)
            ((collection(batch(step, multi_hot=True)) - target) ** 2).sum().backward()
            collection.step()
    interpreted = DEVICE.type == "cpu"
    for name, want in made["torch"].state.items():
        got = made["triton"].state[name].to(want.device)
        assert got.dtype == want.dtype, name
        if interpreted or not want.is_floating_point():
            assert torch.equal(got, want), name
        elif weight_dtype == "fp32":
            assert (got == want).float().mean() > 0.99, name
        else:
            # A half weight a spacing apart after one step (a rounding flipped by the
            # contracted multiply-add) changes the pooled values, so every later gradient
            # of the rows in its bags: the first H200 run had 1.4% of Adam's bf16
            # exp_avg_sq elements apart after 4 steps, all within a few spacings.
            torch.testing.assert_close(got.float(), want.float(), rtol=4 * torch.finfo(want.dtype).eps,
                                       atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert made["torch"].state["rounding_step"].item() == 4
    got, want = made["triton"].weight.detach().float(), made["torch"].weight.detach().float()
    if not interpreted:  # a state a spacing apart moves the next steps a little
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-4)
    elif weight_dtype == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, want)
