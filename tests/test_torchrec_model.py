"""TorchRec backend: shapes, fused optimizer really applied, updates equal a dense reference.

The reference recomputes the same forward with ``torch.nn.EmbeddingBag`` copies of
the tables (ordinary autograd, no TorchRec kernels), through the model's own dense
arches, and checks FBGEMM's fused update against -lr·g (SGD) and the row-wise
Adagrad formula on those gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchrec")

from torchrec import KeyedJaggedTensor

from data.schema import Schema, SparseFeature
from dlrm.config import ConfigError, ModelConfig, OptimConfig
from dlrm.models.torchrec_dlrm import TorchRecDLRM, build_torchrec_dlrm
from dlrm.parallel.planning import tables_from_schema
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer

DIM = 8
# 3 tables: "a" (shared by a and b), "c" (multi-hot), "d"
SCHEMA = Schema(
    dense=("d0", "d1", "d2", "d3"),
    sparse=(
        SparseFeature("a", 20),
        SparseFeature("b", 25, table="a"),
        SparseFeature("c", 30, multi_hot=True),
        SparseFeature("d", 10),
    ),
)
TABLE_OF = {f.name: f.table_name for f in SCHEMA.sparse}
B = 4
# feature-major: a | b | c (bags of 2, 0, 3, 1 ids, duplicates inside and across) | d
IDS = {"a": [1, 2, 1, 5], "b": [3, 24, 1, 0], "c": [[7, 9], [], [7, 7, 11], [9]], "d": [0, 4, 4, 9]}


def _kjt() -> KeyedJaggedTensor:
    values, lengths = [], []
    for f in ("a", "b", "c", "d"):
        for bag in IDS[f]:
            bag = bag if isinstance(bag, list) else [bag]
            values += bag
            lengths.append(len(bag))
    return KeyedJaggedTensor(
        keys=["a", "b", "c", "d"],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )


def _touched() -> dict[str, set[int]]:
    out: dict[str, set[int]] = {"a": set(), "c": set(), "d": set()}
    for f, bags in IDS.items():
        for bag in bags:
            out[TABLE_OF[f]].update(bag if isinstance(bag, list) else [bag])
    return out


def _batch() -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(B, len(SCHEMA.dense), generator=g)
    return dense, _kjt(), torch.tensor([1.0, 0.0, 1.0, 0.0])


@pytest.fixture
def build() -> Iterator[Callable[..., TorchRecDLRM]]:
    """Builds models and, afterwards, destroys the process group they created."""
    models: list[TorchRecDLRM] = []

    def make(
        sparse: str = "sgd",
        pooling: str = "sum",
        interaction: str = "dot",
        lr: float = 0.1,
        seed: int = 0,
    ) -> TorchRecDLRM:
        model_cfg = ModelConfig(
            embedding_dim=DIM, bottom_mlp=[16, DIM], top_mlp=[16, 1], interaction=interaction
        )
        optim_cfg = OptimConfig(sparse=sparse, sparse_lr=lr, eps=1e-8)
        m = build_torchrec_dlrm(SCHEMA, model_cfg, optim_cfg, pooling, torch.device("cpu"), seed)
        models.append(m)
        return m

    yield make
    for m in reversed(models):
        m.close()
    assert not dist.is_initialized()


def _reference(
    model: TorchRecDLRM,
    dense: torch.Tensor,
    kjt: KeyedJaggedTensor,
    labels: torch.Tensor,
    pooling: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits [B] and per-table weight gradients by plain autograd over EmbeddingBag copies."""
    net = model.dmp.module  # the torchrec DLRM inside DMP: its dense arches are plain modules
    bags = {
        t: nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode=pooling)
        for t, w in model.embedding_weights().items()
    }
    jagged = kjt.to_dict()
    pooled = [
        bags[TABLE_OF[f]](jagged[f].values(), jagged[f].offsets()[:-1])
        for f in net.sparse_arch.sparse_feature_names
    ]
    sparse = torch.stack(pooled, dim=1)  # [B, F, D]
    inter = net.inter_arch(dense_features=net.dense_arch(dense), sparse_features=sparse)
    logits = net.over_arch(inter).squeeze(-1)
    nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
    for p in model.dense_parameters():
        p.grad = None
    return logits.detach(), {t: b.weight.grad for t, b in bags.items()}


def _train_step(
    model: TorchRecDLRM, dense: torch.Tensor, kjt: KeyedJaggedTensor, labels: torch.Tensor
) -> torch.Tensor:
    logits = model(dense, kjt)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
    loss.backward()
    for p in model.dense_parameters():
        p.grad = None
    return logits.detach()


def test_forward_shapes_and_plan(build: Callable[..., TorchRecDLRM]) -> None:
    for interaction in ("dot", "dcn"):
        m = build(interaction=interaction)
        dense, kjt, _ = _batch()
        out = m(dense, kjt)
        assert out.shape == (B,) and out.dtype == torch.float32
        assert sorted(m.embedding_weights()) == ["a", "c", "d"]
        assert m.embedding_weights()["a"].shape == (25, DIM)  # shared table: the larger rows
        kernels = {ps.compute_kernel for p in m.dmp.plan.plan.values() for ps in p.values()}
        assert kernels == {"fused"}
        assert all(p.requires_grad for p in m.dense_parameters())
    assert len(m.dense_parameters()) > 8  # DCN adds cross-net parameters to the MLPs'


def test_key_order_of_the_batch_does_not_matter(build: Callable[..., TorchRecDLRM]) -> None:
    m = build(lr=0.0)
    dense, kjt, _ = _batch()
    first = m(dense, kjt)
    order = ["d", "c", "a", "b"]
    permuted = kjt.permute([kjt.keys().index(f) for f in order])
    assert permuted.keys() == order
    torch.testing.assert_close(m(dense, permuted), first)


def test_init_is_seeded_and_matches_native_collection(build: Callable[..., TorchRecDLRM]) -> None:
    m1, m2, m3 = build(seed=3), build(seed=3), build(seed=4)
    w1, w2, w3 = m1.embedding_weights(), m2.embedding_weights(), m3.embedding_weights()
    native = LocalEmbeddingCollection(
        tables_from_schema(SCHEMA, DIM, "sum"), make_sparse_optimizer("sgd"), seed=3
    ).export_tables()
    for t in w1:
        assert torch.equal(w1[t], w2[t])
        assert not torch.equal(w1[t], w3[t])
        assert torch.equal(w1[t], native[f"{t}.weight"])
    for p1, p2 in zip(m1.dense_parameters(), m2.dense_parameters()):
        assert torch.equal(p1, p2)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_sgd_update_equals_dense_reference_and_lr_changes(
    build: Callable[..., TorchRecDLRM], pooling: str
) -> None:
    m = build(sparse="sgd", pooling=pooling, lr=0.1)
    dense, kjt, labels = _batch()
    touched = _touched()
    for lr in (0.1, 0.35):  # the second step runs at the lr set by sparse_step
        m.sparse_step(lr)
        before = m.embedding_weights()
        ref_logits, grads = _reference(m, dense, kjt, labels, pooling)
        logits = _train_step(m, dense, kjt, labels)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
        after = m.embedding_weights()
        for t in before:
            delta = after[t] - before[t]
            changed = set(delta.abs().sum(1).nonzero().flatten().tolist())
            assert changed == touched[t], t
            torch.testing.assert_close(delta, -lr * grads[t], rtol=1e-4, atol=1e-7)


def test_rowwise_adagrad_first_step_matches_formula(build: Callable[..., TorchRecDLRM]) -> None:
    lr, eps = 0.05, 1e-8
    m = build(sparse="rowwise_adagrad", lr=lr)
    dense, kjt, labels = _batch()
    before = m.embedding_weights()
    _, grads = _reference(m, dense, kjt, labels, "sum")
    _train_step(m, dense, kjt, labels)
    after = m.embedding_weights()
    for t, g in grads.items():
        state = g.pow(2).mean(dim=1, keepdim=True)  # starts at 0
        expect = -lr * g / (state.sqrt() + eps)
        torch.testing.assert_close(after[t] - before[t], expect, rtol=1e-4, atol=1e-6)
        untouched = sorted(set(range(g.shape[0])) - _touched()[t])
        assert torch.equal(after[t][untouched], before[t][untouched])


def test_adagrad_maps_to_exact_adagrad_and_matches_formula(build: Callable[..., TorchRecDLRM]) -> None:
    """optim.sparse=adagrad is fbgemm's EXACT_ADAGRAD: a sum of g² per element, over
    two steps (the second divides by the sum of both steps' squares)."""
    lr, eps = 0.05, 1e-8
    m = build(sparse="adagrad", lr=lr)
    momentum = {k: v for s in m.dmp.fused_optimizer.state_dict()["state"].values() for k, v in s.items()}
    assert {k: tuple(v.shape) for k, v in momentum.items()} == {  # a sum per element
        f"{t}.momentum1": tuple(w.shape) for t, w in m.embedding_weights().items()}
    dense, kjt, labels = _batch()
    state = {t: torch.zeros_like(w) for t, w in m.embedding_weights().items()}
    for _ in range(2):
        before = m.embedding_weights()
        _, grads = _reference(m, dense, kjt, labels, "sum")
        _train_step(m, dense, kjt, labels)
        after = m.embedding_weights()
        for t, g in grads.items():
            state[t] += g.square()
            expect = -lr * g / (state[t].sqrt() + eps)
            torch.testing.assert_close(after[t] - before[t], expect, rtol=1e-4, atol=1e-6)
            untouched = sorted(set(range(g.shape[0])) - _touched()[t])
            assert torch.equal(after[t][untouched], before[t][untouched])


@pytest.mark.slow
def test_training_reduces_loss_and_zero_lr_freezes_tables(
    build: Callable[..., TorchRecDLRM],
) -> None:
    m = build(sparse="rowwise_adagrad", lr=0.05)
    dense, kjt, labels = _batch()
    opt = torch.optim.SGD(m.dense_parameters(), lr=0.1)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(m(dense, kjt), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    m.sparse_step(0.0)
    before = m.embedding_weights()
    _train_step(m, dense, kjt, labels)
    after = m.embedding_weights()
    assert all(torch.equal(before[t], after[t]) for t in before)


def test_adam_on_cpu_is_a_config_error() -> None:
    optim_cfg = OptimConfig(sparse="adam")
    with pytest.raises(ConfigError, match="adam"):
        build_torchrec_dlrm(
            SCHEMA,
            ModelConfig(embedding_dim=DIM, bottom_mlp=[DIM]),
            optim_cfg,
            "sum",
            torch.device("cpu"),
            0,
        )
    assert not dist.is_initialized()


def test_plan_pins_become_torchrec_constraints() -> None:
    from dlrm.config import ConfigError
    from dlrm.models.torchrec_dlrm import constraints_from_pins

    got = constraints_from_pins({"a": "table_wise", "c": "column_wise"}, torch.device("cpu"))
    assert got["a"].sharding_types == ["table_wise"] and got["c"].sharding_types == ["column_wise"]
    for bad in ("row_wise", "data_parallel"):
        with pytest.raises(ConfigError, match=bad):
            constraints_from_pins({"a": bad}, torch.device("cpu"))


def _tables_rank(rank: int, world_size: int) -> dict:
    """Rank r's shards of four reference tables: one whole on rank 0, one whole on rank
    1, one split by rows, one by columns over both ranks."""
    from dlrm.models.torchrec_dlrm import tables_on_rank_0

    ref = _reference_tables()
    shards = {"on0": [((0, 0), ref["on0"])] if rank == 0 else [],
              "on1": [((0, 0), ref["on1"])] if rank == 1 else [],
              "rows": [((rank * 3, 0), ref["rows"][rank * 3 : rank * 3 + 3])],
              "cols": [((0, rank * 4), ref["cols"][:, rank * 4 : rank * 4 + 4])]}
    got = tables_on_rank_0({k: v for k, v in shards.items() if v}, {k: tuple(v.shape) for k, v in ref.items()})
    return {k: v.clone() for k, v in got.items()}


def _reference_tables() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"on0": torch.randn(5, 8, generator=gen), "on1": torch.randn(7, 8, generator=gen),
            "rows": torch.randn(6, 8, generator=gen), "cols": torch.randn(4, 8, generator=gen)}


@pytest.mark.distributed
def test_the_save_assembles_every_table_on_rank_0_alone() -> None:
    """The TorchRec backend's save at several ranks: rank 0 gets every whole table
    (sent whole, its own as is, or summed from row and column shards), the others
    none: no rank holds every rank's copies of every table."""
    from tests.multiprocess import run_ranks

    on_0, on_1 = run_ranks(2, _tables_rank)
    assert on_1 == {}
    ref = _reference_tables()
    assert on_0.keys() == {f"{k}.weight" for k in ref}
    for k, v in ref.items():
        assert torch.equal(on_0[f"{k}.weight"], v), k
