"""DLRM model: interactions against naive references, and the whole model against
TorchRec's own DLRM carrying the same weights."""

from __future__ import annotations

import itertools

import pytest
import torch

from data.schema import Schema, SparseFeature
from dlrm.config import Config, ModelConfig
from dlrm.models.interaction import CrossInteraction, DotInteraction
from dlrm.parallel.parallelize import build_model
from dlrm.train.optim import lr_factor


def test_dot_interaction_matches_pairwise_loop() -> None:
    torch.manual_seed(0)
    batch, num_sparse, dim = 5, 4, 3
    dense, pooled = torch.randn(batch, dim), torch.randn(batch, num_sparse * dim)
    out = DotInteraction(num_sparse, dim)(dense, pooled)
    vecs = [dense] + list(pooled.split(dim, dim=1))
    pairs = [(vecs[i] * vecs[j]).sum(1) for i, j in itertools.combinations(range(num_sparse + 1), 2)]
    torch.testing.assert_close(out, torch.cat([dense, torch.stack(pairs, 1)], 1))


@pytest.mark.parametrize("rank", [0, 2])
def test_cross_interaction_matches_formula(rank: int) -> None:
    torch.manual_seed(0)
    net = CrossInteraction(num_sparse=2, dim=3, layers=2, rank=rank)
    dense, pooled = torch.randn(4, 3), torch.randn(4, 6)
    x0 = torch.cat([dense, pooled], 1)
    x = x0
    for down, up in zip(net.down, net.up):
        w = up.weight if rank == 0 else up.weight @ down.weight
        x = x0 * (x @ w.T + up.bias) + x
    torch.testing.assert_close(net(dense, pooled), x)


def test_model_equals_torchrec_dlrm_with_same_weights() -> None:
    """Also: our model takes a ``KeyedJaggedTensor`` as it is."""
    pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM as TorchRecDLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    schema = Schema(
        label="label",
        dense=("x0", "x1", "x2"),
        sparse=(SparseFeature("a", rows=20), SparseFeature("b", rows=9, multi_hot=True)),
    )
    cfg = Config(model=ModelConfig(embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 1]))
    ours = build_model(cfg, schema)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f.name, embedding_dim=4, num_embeddings=f.rows, feature_names=[f.name])
            for f in schema.sparse
        ]
    )
    theirs = TorchRecDLRM(
        embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[6, 1]
    )
    tables = ours.embeddings.export_tables()
    with torch.no_grad():
        for f in schema.sparse:
            ebc.embedding_bags[f.name].weight.copy_(tables[f"{f.name}.weight"])
        arch = ours.dense_arch
        ours_linear = [m for m in list(arch.bottom) + list(arch.top) if isinstance(m, torch.nn.Linear)]
        theirs_linear = [m for m in theirs.modules() if isinstance(m, torch.nn.Linear)]
        assert len(ours_linear) == len(theirs_linear) == 4
        for a, b in zip(ours_linear, theirs_linear):
            b.weight.copy_(a.weight)
            b.bias.copy_(a.bias)
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 19, 3, 0, 8, 8, 2]),
        lengths=torch.tensor([1, 1, 1, 0, 3, 1]),
    )
    dense = torch.randn(3, 3)
    torch.testing.assert_close(ours(dense, kjt), theirs(dense, kjt).squeeze(1))


def test_bottom_mlp_must_end_with_embedding_dim() -> None:
    schema = Schema(dense=("x",), sparse=(SparseFeature("a", rows=3),))
    with pytest.raises(ValueError, match="bottom_mlp"):
        build_model(Config(model=ModelConfig(embedding_dim=8, bottom_mlp=[16, 4])), schema)


def test_lr_schedule_warmup_and_decay() -> None:
    cfg = Config()
    cfg.optim.warmup_steps, cfg.optim.decay_start, cfg.optim.decay_steps = 4, 10, 5
    factors = [lr_factor(cfg, s) for s in range(17)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4:11] == [1.0] * 7
    assert factors[12] == pytest.approx(0.6) and factors[15] == 0.0 and factors[16] == 0.0


def test_dot_interaction_gradient_matches_autograd() -> None:
    torch.manual_seed(1)
    dense = torch.randn(6, 4, requires_grad=True)
    pooled = torch.randn(6, 3 * 4, requires_grad=True)
    upstream = torch.randn(6, 4 + 6)
    (DotInteraction(3, 4)(dense, pooled) * upstream).sum().backward()
    d2, p2 = dense.detach().clone().requires_grad_(), pooled.detach().clone().requires_grad_()
    x = torch.cat([d2, p2], 1).view(6, 4, 4)
    rows, cols = torch.triu_indices(4, 4, offset=1)
    ref = torch.cat([d2, torch.bmm(x, x.transpose(1, 2))[:, rows, cols]], 1)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(dense.grad, d2.grad)
    torch.testing.assert_close(pooled.grad, p2.grad)
