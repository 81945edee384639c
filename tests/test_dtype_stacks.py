"""One process, tables of several dtypes (``DtypeStacks``): one stack per dtype.

Reference: each dtype's tables alone in a ``LocalEmbeddingCollection`` of their own, on
the same batches and the same kernels (tests/test_mixed_dtypes.py's ``train_groups_alone``
idea): tables are independent given the pooled gradients, and the rounding is keyed by
table, row and column, not by stack. On the Triton path every stack takes the whole
batch and skips the other stacks' features; a row's gradient is summed in the same
lookup order as in its group alone, so the result is the same bits, every dtype.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from data.jagged import JaggedFeatures
from embeddings.collection import LocalEmbeddingCollection
from embeddings.dtype_stacks import DtypeStacks
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling, TableSpec

DTYPES = {"t0": "bf16", "t1": "fp32", "t2": "fp16"}  # t1 serves two features; the fp32 stack is not first
FEATURES = ["a", "b", "c", "d"]
ROWS = {"a": 7, "b": 5, "c": 5, "d": 6}
DIM = 12


def tables(pooling: Pooling) -> list[TableSpec]:
    return [TableSpec("t0", 7, DIM, ("a",), pooling, dtype=DTYPES["t0"]),
            TableSpec("t1", 5, DIM, ("b", "c"), pooling, dtype=DTYPES["t1"]),
            TableSpec("t2", 6, DIM, ("d",), pooling, dtype=DTYPES["t2"])]


def batch(step: int, multi_hot: bool, keys: list[str]) -> JaggedFeatures:
    """B=4, bags in ``keys``' order."""
    gen = torch.Generator().manual_seed(step)
    lengths = (torch.randint(0, 3, (len(keys) * 4,), generator=gen) if multi_hot
               else torch.ones(len(keys) * 4, dtype=torch.long))
    values = torch.cat([torch.randint(0, ROWS[keys[i // 4]], (int(n),), generator=gen) for i, n in enumerate(lengths)])
    return JaggedFeatures(keys, values, lengths, stride=4).to(DEVICE)


def only(kjt: JaggedFeatures, features: list[str]) -> JaggedFeatures:
    per_feature = kjt.lengths().view(len(kjt.keys()), kjt.stride())
    values = kjt.values().split(per_feature.sum(dim=1).tolist())
    pick = [kjt.keys().index(f) for f in features]
    return JaggedFeatures(features, torch.cat([values[i] for i in pick]), torch.cat([per_feature[i] for i in pick]),
                          stride=kjt.stride())


CASES = [("triton", "sgd", Pooling.SUM, False, "fp32"), ("triton", "rowwise_adagrad", Pooling.MEAN, True, "fp32"),
         ("triton", "adam", Pooling.SUM, True, "bf16"), ("triton", "adagrad", Pooling.MEAN, True, "fp16"),
         ("torch", "adam", Pooling.MEAN, True, "fp32")]


@pytest.mark.parametrize("kernels,optimizer,pooling,multi_hot,state", CASES)
@pytest.mark.parametrize("fused", [True, False])
def test_stacks_equal_each_dtype_alone(kernels: str, optimizer: str, pooling: Pooling, multi_hot: bool,
                                       state: str, fused: bool) -> None:
    made = DtypeStacks(tables(pooling), lambda: make_sparse_optimizer(optimizer, state_dtype=state), fused=fused,
                       seed=3, device=DEVICE, rounding_seed=11, kernels=kernels)
    alone = {}
    for dtype in dict.fromkeys(DTYPES.values()):
        opt = make_sparse_optimizer(optimizer, state_dtype=state)
        opt.rounding = True  # as in the stacks: every stack counts its updates
        alone[dtype] = LocalEmbeddingCollection([t for t in tables(pooling) if t.dtype == dtype], opt, fused=fused,
                                                seed=3, device=DEVICE, rounding_seed=11, kernels=kernels)
    assert [s.weight.dtype for s in made.stacks] == [torch.bfloat16, torch.float32, torch.float16]
    assert made.on_triton() is (kernels == "triton")
    for step in range(3):
        kjt = batch(step, multi_hot, keys=["d", "b", "a", "c"])  # not the collection's order
        upstream = torch.randn(4, len(FEATURES) * DIM, generator=torch.Generator().manual_seed(50 + step)).to(DEVICE)
        made.set_lr(0.05)
        got = made(kjt)
        (got * upstream).sum().backward()
        made.step()
        for coll in alone.values():
            coll.set_lr(0.05)
            out = coll(only(kjt, coll.features))
            columns = torch.tensor([FEATURES.index(f) * DIM + c for f in coll.features for c in range(DIM)])
            (out * upstream[:, columns.to(DEVICE)]).sum().backward()
            coll.step()
            assert torch.equal(got[:, columns.to(DEVICE)], out.detach()), f"step {step} {coll.features}"
    want = {k: v for coll in alone.values() for k, v in coll.export_tables().items()}
    have = made.export_tables()
    assert sorted(have) == sorted(want)
    for key, value in want.items():
        assert have[key].dtype == value.dtype and torch.equal(have[key], value), key


def test_triton_stacks_step_has_no_host_sync() -> None:
    """Forward, backward and the fused update of every stack read nothing on the host
    and no shape depends on the data: what a CUDA graph needs (dlrm/train/graphs.py).
    The torch path's split, for contrast, reads the value counts."""
    from dlrm.train.sync_audit import SyncAudit

    made = DtypeStacks(tables(Pooling.MEAN), lambda: make_sparse_optimizer("adam", state_dtype="bf16"), seed=1,
                       device=DEVICE, kernels="triton")
    kjt = batch(0, True, keys=FEATURES)
    made.set_lr(0.1)
    made(kjt).sum().backward()  # the first step moves lr and the step counts to the device
    with SyncAudit() as audit:
        made.set_lr(0.05)
        made(kjt).sum().backward()
        made.step()
    assert audit.violations == [], audit.violations
    assert audit.ops["triton._pooled_kernel"] == 3 and audit.ops["triton._runs_kernel"] == 3
    torch_path = DtypeStacks(tables(Pooling.MEAN), lambda: make_sparse_optimizer("sgd"), seed=1, device=DEVICE,
                             kernels="torch")
    with SyncAudit() as audit:
        torch_path(kjt).sum().backward()
    assert audit.violations


def test_checkpoint_of_the_sharded_one_rank_layout_loads(tmp_path) -> None:
    """Runs of several dtypes in one process were the sharded collection on one rank
    before DtypeStacks: their checkpoints load into the stacks (and back), every
    table and its state bit for bit, each in its type."""
    from dlrm.checkpoint.tables import load_embeddings, save_embeddings
    from embeddings.plan.planner import fixed_plan
    from embeddings.plan.types import ShardingType
    from embeddings.sharded import ShardedEmbeddingCollection, gather_tables

    specs = tables(Pooling.SUM)
    plan = fixed_plan(specs, 1, {t.name: (ShardingType.TABLE_WISE, [0]) for t in specs})
    old = ShardedEmbeddingCollection(specs, plan, lambda: make_sparse_optimizer("adam", state_dtype="bf16"), seed=3)
    old.set_lr(0.1)
    (old(batch(0, True, FEATURES).to(torch.device("cpu"))) ** 2).sum().backward()  # state worth saving
    save_embeddings(tmp_path / "old", old.table_state())
    stacks = DtypeStacks(specs, lambda: make_sparse_optimizer("adam", state_dtype="bf16"), seed=None)
    load_embeddings(tmp_path / "old", stacks.table_state())
    want, got = gather_tables(old), stacks.export_tables()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    save_embeddings(tmp_path / "new", stacks.table_state())
    back = ShardedEmbeddingCollection(specs, plan, lambda: make_sparse_optimizer("adam", state_dtype="bf16"),
                                      seed=None)
    load_embeddings(tmp_path / "new", back.table_state())
    for key, value in gather_tables(back).items():
        assert torch.equal(value, want[key]), key
