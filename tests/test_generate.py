"""The synthetic generator: layout, reproducibility, Zipf ids, bags, and a learnable signal."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from data.errors import UserError
from data.generate import GenerateConfig, generate_dataset, generator_schema
from data.schema import infer_schema

SMALL = GenerateConfig(dense=4, sparse=8, table_rows=[200], multi_hot=2, max_bag=4,
                       row_group_rows=4096, file_rows=100_000)


def _read(files: list[str]) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in files])


def test_schema_and_file_layout(tmp_path: Path) -> None:
    cfg = GenerateConfig(dense=3, sparse=4, table_rows=[5, 6, 7, 8], multi_hot=1,
                         row_group_rows=300, file_rows=1000)
    files = generate_dataset(str(tmp_path), cfg, seed=1, rows=2500)
    assert files == [str(tmp_path / f"part-0000{i}.parquet") for i in range(3)]
    assert sorted(os.listdir(tmp_path)) == [f"part-0000{i}.parquet" for i in range(3)]
    groups = [[pq.ParquetFile(f).metadata.row_group(g).num_rows
               for g in range(pq.ParquetFile(f).metadata.num_row_groups)] for f in files]
    assert groups == [[300, 300, 300, 100], [300, 300, 300, 100], [300, 200]]
    schema = generator_schema(cfg)
    assert schema.columns == ["label", "I1", "I2", "I3", "C1", "C2", "C3", "C4"]
    assert [(f.rows, f.multi_hot) for f in schema.sparse] == [(5, 0), (6, 0), (7, 0), (8, 1)]
    t = _read(files)
    assert t.schema.field("label").type == pa.float32() and t.schema.field("I2").type == pa.float32()
    assert t.schema.field("C1").type == pa.int64()
    assert t.schema.field("C4").type.value_type == pa.int64()
    inferred = infer_schema(files)
    assert inferred.dense == schema.dense and inferred.sparse_names == schema.sparse_names
    assert [f.multi_hot for f in inferred.sparse] == [f.multi_hot for f in schema.sparse]
    assert all(i.rows <= s.rows for i, s in zip(inferred.sparse, schema.sparse))


def test_rows_default_to_the_config_and_stale_parts_go(tmp_path: Path) -> None:
    cfg = GenerateConfig(dense=1, sparse=1, rows=250, row_group_rows=100, file_rows=100)
    assert len(generate_dataset(str(tmp_path), cfg)) == 3
    assert generate_dataset(str(tmp_path), cfg, rows=150) == [
        str(tmp_path / "part-00000.parquet"), str(tmp_path / "part-00001.parquet")]
    assert sorted(os.listdir(tmp_path)) == ["part-00000.parquet", "part-00001.parquet"]


def test_reproducible_and_seeded(tmp_path: Path) -> None:
    def run(name: str, seed: int) -> list[bytes]:
        files = generate_dataset(str(tmp_path / name), SMALL, seed=seed, rows=5000)
        return [Path(f).read_bytes() for f in files]

    assert run("a", 3) == run("b", 3)
    assert run("a", 3) != run("c", 4)
    a = _read([str(tmp_path / "a" / "part-00000.parquet")])
    c = _read([str(tmp_path / "c" / "part-00000.parquet")])
    assert not np.array_equal(a.column("C1").to_numpy(), c.column("C1").to_numpy())


def test_zipf_ids_bags_dense_and_ctr(tmp_path: Path) -> None:
    cfg = GenerateConfig(dense=13, sparse=4, table_rows=[1000, 50, 1000, 7], multi_hot=2,
                         max_bag=5)
    t = _read(generate_dataset(str(tmp_path), cfg, seed=0, rows=20_000))
    ids = t.column("C1").to_numpy()
    counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
    share = counts[:10].sum() / counts.sum()
    assert 0.38 < share < 0.49  # exact Zipf(1.05) over 1000 ranks: 0.436
    assert sorted(np.argsort(-np.bincount(ids))[:10].tolist()) != list(range(10))  # scattered
    for name, rows in [("C1", 1000), ("C2", 50), ("C3", 1000), ("C4", 7)]:
        col = t.column(name)
        if pa.types.is_list(col.type):
            lengths = col.combine_chunks().value_lengths().to_numpy()
            assert set(np.unique(lengths)) == set(range(6))
            col = col.combine_chunks().flatten()
        values = col.to_numpy()
        assert values.min() >= 0 and values.max() < rows
    dense = np.stack([t.column(f"I{j}").to_numpy() for j in range(1, 14)], 1)
    assert dense.min() >= 0 and (dense == 0).mean() > 0.01 and dense.max() > 5
    assert 0.2 < t.column("label").to_numpy().mean() < 0.3


def _features(t: pa.Table, cfg: GenerateConfig) -> sp.csr_matrix:
    """Dense columns plus one-hot ids (a bag spreads weight 1 over its ids)."""
    n, rows = t.num_rows, cfg.table_rows[0]
    blocks = [sp.csr_matrix(np.stack([t.column(f"I{j + 1}").to_numpy()
                                      for j in range(cfg.dense)], 1))]
    for c in range(cfg.sparse):
        col = t.column(f"C{c + 1}").combine_chunks()
        if pa.types.is_list(col.type):
            lengths = col.value_lengths().fill_null(0).to_numpy()
            ids = col.flatten().to_numpy()
            weight = 1.0 / np.repeat(np.maximum(lengths, 1), lengths)
            owner = np.repeat(np.arange(n), lengths)
        else:
            ids, weight, owner = col.to_numpy(), np.ones(n), np.arange(n)
        blocks.append(sp.csr_matrix((weight, (owner, ids)), shape=(n, rows)))
    return sp.hstack(blocks).tocsr()


@pytest.mark.slow
def test_planted_signal_generalises_to_another_seed(tmp_path: Path) -> None:
    train = _read(generate_dataset(str(tmp_path / "train"), SMALL, seed=1, rows=20_000))
    test = _read(generate_dataset(str(tmp_path / "test"), SMALL, seed=2, rows=20_000))
    model = LogisticRegression(C=0.3, max_iter=500)
    model.fit(_features(train, SMALL), train.column("label").to_numpy())
    scores = model.predict_proba(_features(test, SMALL))[:, 1]
    assert roc_auc_score(test.column("label").to_numpy(), scores) > 0.70


def test_signal_zero_gives_no_signal(tmp_path: Path) -> None:
    cfg = GenerateConfig(dense=4, sparse=8, table_rows=[200], signal=0.0)
    t = _read(generate_dataset(str(tmp_path), cfg, rows=20_000))
    y = t.column("label").to_numpy()
    assert abs(roc_auc_score(y, t.column("I1").to_numpy()) - 0.5) < 0.03


@pytest.mark.parametrize("bad", [
    {"table_rows": [10, 20]}, {"multi_hot": 30}, {"table_rows": [0]}, {"row_group_rows": 0},
])
def test_bad_configs_are_user_errors(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(UserError, match="generate"):
        generate_dataset(str(tmp_path), GenerateConfig(**bad), rows=10)
