"""The TorchRec backend writes each table's initial values once, and they are ours.

Building the sharded model once wrote every table three times over: TorchRec's fused
kernel drew uniform values (``BatchedFusedEmbeddingBag.init_parameters``), the sharded
collection drew them again (``ShardedEmbeddingBagCollection.reset_parameters``, the
config's default ``init_fn``), then ``_init_tables_`` wrote ours
(``embeddings.init.init_rows``). A dispatch mode here counts the elements that
in-place ops write into each table's memory during the build: exactly the table's
size, once. (The allocation's zero-fill is not counted: it is how FBGEMM allocates.)
The values are compared with the native collection's tables for the same seed, an
independent reference (it never touches TorchRec).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torchrec")

from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.planner.types import ParameterConstraints

from data.schema import Schema, SparseFeature
from dlrm.config import ModelConfig, OptimConfig
from dlrm.models.torchrec_dlrm import TorchRecDLRM, _local_shards, build_torchrec_dlrm
from dlrm.parallel.planning import tables_from_schema
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer

DIM = 16
# "a" is shared by two features (the larger row count); "c" may be split column-wise.
# Every table is under embeddings.init.STAGE_ROWS rows: init_rows then runs on this
# thread, where the dispatch mode sees its writes.
SCHEMA = Schema(
    dense=("d0", "d1"),
    sparse=(SparseFeature("a", 300), SparseFeature("b", 700, table="a"),
            SparseFeature("c", 5000), SparseFeature("d", 40)),
)


class InPlaceWrites(TorchDispatchMode):
    """Records (data_ptr, elements) of every in-place op's target but ``zero_``."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        schema = func._schema
        first = schema.arguments[0] if schema.arguments else None
        writes = first is not None and first.alias_info is not None and first.alias_info.is_write
        if writes and func is not torch.ops.aten.zero_.default and isinstance(args[0], torch.Tensor):
            self.writes.append((args[0].data_ptr(), args[0].numel()))
        return func(*args, **(kwargs or {}))


def _elements_written(model: TorchRecDLRM, writes: list[tuple[int, int]]) -> dict[str, int]:
    """Per table: elements of the in-place writes whose target starts in its shards."""
    out = {}
    for name, shards in _local_shards(model.dmp).items():
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for _, t in shards]
        out[name] = sum(n for ptr, n in writes if any(lo <= ptr < hi for lo, hi in spans))
    return out


@pytest.fixture
def built() -> Iterator[list[TorchRecDLRM]]:
    models: list[TorchRecDLRM] = []
    yield models
    for m in reversed(models):
        m.close()
    assert not dist.is_initialized()


# "c" column-wise in 8-column shards: two shards of one table on this one rank
SPLIT_C = {"c": ParameterConstraints(sharding_types=["column_wise"], compute_kernels=["fused"],
                                     min_partition=8)}


@pytest.mark.parametrize("constraints", [{}, SPLIT_C], ids=["planner", "c_column_wise"])
def test_each_table_is_written_once_with_the_native_values(
    built: list[TorchRecDLRM], constraints: dict[str, ParameterConstraints]
) -> None:
    kernel_init = BaseBatchedEmbeddingBag.init_parameters
    model_cfg = ModelConfig(embedding_dim=DIM, bottom_mlp=[8, DIM], top_mlp=[8, 1])
    with InPlaceWrites() as mode:
        model = build_torchrec_dlrm(SCHEMA, model_cfg, OptimConfig(sparse="sgd"), "sum",
                                    torch.device("cpu"), seed=5, constraints=constraints)
    built.append(model)
    shards = _local_shards(model.dmp)
    if constraints:
        assert sorted(c for (_, c), _ in shards["c"]) == [0, 8]

    sizes = {name: rows * dim for name, (rows, dim) in model.table_shapes.items()}
    assert _elements_written(model, mode.writes) == sizes  # once each, not 3x

    native = LocalEmbeddingCollection(
        tables_from_schema(SCHEMA, DIM, "sum"), make_sparse_optimizer("sgd"), seed=5
    ).export_tables()
    weights = model.embedding_weights()
    assert sorted(weights) == ["a", "c", "d"]
    for name, w in weights.items():
        assert torch.equal(w, native[f"{name}.weight"])
    # TorchRec's own kernel init is only held back while this backend builds
    assert BaseBatchedEmbeddingBag.init_parameters is kernel_init


def test_a_build_for_a_resume_writes_no_table_and_the_load_fills_them(
    built: list[TorchRecDLRM],
) -> None:
    """``resume=True`` (``dlrm train`` found a checkpoint, which overwrites every table):
    no initial values at all; loading a saved model's state gives its tables."""
    model_cfg = ModelConfig(embedding_dim=DIM, bottom_mlp=[8, DIM], top_mlp=[8, 1])

    def build(resume: bool) -> TorchRecDLRM:
        m = build_torchrec_dlrm(SCHEMA, model_cfg, OptimConfig(sparse="sgd"), "sum",
                                torch.device("cpu"), seed=5, resume=resume)
        built.append(m)
        return m

    saved = build(resume=False)
    with InPlaceWrites() as mode:
        resumed = build(resume=True)
    assert _elements_written(resumed, mode.writes) == {"a": 0, "c": 0, "d": 0}
    resumed.import_state(saved.export_state())
    want = saved.embedding_weights()
    for name, w in resumed.embedding_weights().items():
        assert torch.equal(w, want[name])
