"""Embedding collection: pooled lookups and KV gradients against dense autograd,
sparse optimizers against torch's dense/sparse reference optimizers."""

from __future__ import annotations

from dataclasses import replace as dataclass_replace

import pytest
import torch
from torch import nn

from data.jagged import JaggedFeatures
from embeddings.collection import LocalEmbeddingCollection
from embeddings.kv import KVGradient
from embeddings.optim import (
    RowWiseAdagrad,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
    make_sparse_optimizer,
)
from embeddings.table import Pooling, TableSpec


def random_kjt(features: list[str], rows: dict[str, int], batch: int, max_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in features:
        ln = torch.randint(0, max_len + 1, (batch,), generator=g)
        lengths.append(ln)
        values.append(torch.randint(0, rows[f], (int(ln.sum()),), generator=g))
    return JaggedFeatures(
        keys=features, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def tables_fixture(pooling: Pooling = Pooling.SUM) -> list[TableSpec]:
    # t_shared serves two features: both must see the same rows.
    return [
        TableSpec("t0", rows=50, dim=4, features=("a",), pooling=pooling),
        TableSpec("t_shared", rows=30, dim=4, features=("b", "c"), pooling=pooling),
        TableSpec("t2", rows=7, dim=4, features=("d",), pooling=pooling),
    ]


def dense_reference(coll: LocalEmbeddingCollection, kjt, pooling: Pooling):
    """Same lookups with nn.EmbeddingBag copies of each table (dense autograd)."""
    bags = {
        t.name: nn.EmbeddingBag.from_pretrained(
            coll.export_tables()[f"{t.name}.weight"].clone(), freeze=False, mode=pooling.value
        )
        for t in coll.tables
    }
    table_of = {f: t.name for t in coll.tables for f in t.features}
    outs = []
    for f in coll.features:
        jt = kjt[f]
        outs.append(bags[table_of[f]](jt.values(), jt.offsets()[:-1]))
    return torch.cat(outs, dim=1), bags


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
@pytest.mark.parametrize("max_len", [1, 4])
def test_pooled_and_kv_gradients_match_dense_autograd(pooling: Pooling, max_len: int) -> None:
    tables = tables_fixture(pooling)
    coll = LocalEmbeddingCollection(tables, SparseSGD(), fused=False, seed=3)
    rows = {f: t.rows for t in tables for f in t.features}
    # Keys in another order than the collection's: it must permute.
    kjt = random_kjt(["d", "c", "b", "a"], rows, batch=9, max_len=max_len, seed=1)
    pooled = coll(kjt)
    ref, bags = dense_reference(coll, kjt, pooling)
    assert pooled.shape == (9, 4 * 4)
    torch.testing.assert_close(pooled, ref)

    upstream = torch.randn_like(pooled)
    (pooled * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert coll.weight.grad is None  # nothing dense and table-sized
    grads = coll.kv_gradients()
    for t in tables:
        dense_grad = bags[t.name].weight.grad
        touched = dense_grad.abs().sum(1).nonzero().flatten()
        kv = grads.get(t.name)
        if kv is None:
            assert touched.numel() == 0
            continue
        assert torch.equal(kv.ids, kv.ids.unique())
        # Every touched row appears; rows with an exact-zero sum may appear too.
        assert set(touched.tolist()) <= set(kv.ids.tolist())
        torch.testing.assert_close(kv.rows, dense_grad[kv.ids])


def test_kv_coalesce_and_slice() -> None:
    g = KVGradient.from_lookups(torch.tensor([7, 3, 7, 9]), torch.tensor([[1.0], [2.0], [4.0], [8.0]]))
    assert g.ids.tolist() == [3, 7, 9]
    assert g.rows.flatten().tolist() == [2.0, 5.0, 8.0]
    merged = KVGradient.cat([g, KVGradient(torch.tensor([3, 10]), torch.tensor([[1.0], [1.0]]))])
    assert merged.ids.tolist() == [3, 7, 9, 10]
    assert merged.rows.flatten().tolist() == [3.0, 5.0, 8.0, 1.0]
    part = merged.slice_rows(7, 10)
    assert part.ids.tolist() == [0, 2] and part.rows.flatten().tolist() == [5.0, 8.0]


def _train_collection(kind: str, fused: bool, steps: int, lr: float):
    tables = tables_fixture()
    coll = LocalEmbeddingCollection(tables, make_sparse_optimizer(kind), fused=fused, seed=5)
    rows = {f: t.rows for t in tables for f in t.features}
    kjts = [random_kjt(["a", "b", "c", "d"], rows, batch=6, max_len=3, seed=s) for s in range(steps)]
    ups = [torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]
    return coll, kjts, ups


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_sparse_optimizers_match_torch_reference(kind: str, fused: bool) -> None:
    lr, steps = 0.1, 4
    coll, kjts, ups = _train_collection(kind, fused, steps, lr)
    start = {k: v.clone() for k, v in coll.export_tables().items()}
    tables = coll.tables
    # Reference: one nn.Embedding(sparse=True) per table, torch optimizers.
    ref_tables = {
        t.name: nn.Embedding.from_pretrained(start[f"{t.name}.weight"].clone(), freeze=False, sparse=True)
        for t in tables
    }
    params = [e.weight for e in ref_tables.values()]
    if kind == "sgd":
        ref_opt = torch.optim.SGD(params, lr=lr)
    elif kind == "adam":
        ref_opt = torch.optim.SparseAdam(params, lr=lr, eps=1e-8)
    elif kind == "adagrad":  # stepped on dense gradients: untouched rows add 0 and move by 0
        ref_opt = torch.optim.Adagrad(params, lr=lr, eps=1e-8, initial_accumulator_value=0.0)
    else:
        ref_opt = None
        ref_state = {t.name: torch.zeros(t.rows) for t in tables}
    table_of = {f: t.name for t in tables for f in t.features}
    for kjt, up in zip(kjts, ups):
        coll.set_lr(lr)
        (coll(kjt) * up).sum().backward()
        coll.step()
        outs = []
        for f in coll.features:
            jt = kjt[f]
            emb = ref_tables[table_of[f]]
            outs.append(nn.functional.embedding_bag(jt.values(), emb.weight, jt.offsets()[:-1], mode="sum", sparse=True))
        for p in params:
            p.grad = None
        (torch.cat(outs, 1) * up).sum().backward()
        if kind == "adagrad":
            for p in params:
                p.grad = p.grad.to_dense()
        if ref_opt is not None:
            ref_opt.step()
        else:  # row-wise Adagrad, written densely over the touched rows
            with torch.no_grad():
                for name, emb in ref_tables.items():
                    dense = emb.weight.grad.to_dense()
                    touched = dense.abs().sum(1) > 0
                    ref_state[name][touched] += dense[touched].pow(2).mean(1)
                    emb.weight[touched] -= lr * dense[touched] / (ref_state[name][touched].sqrt() + 1e-8).unsqueeze(1)
    final = coll.export_tables()
    for t in tables:
        torch.testing.assert_close(final[f"{t.name}.weight"], ref_tables[t.name].weight.detach(), rtol=1e-5, atol=1e-6)
        if kind == "rowwise_adagrad":
            torch.testing.assert_close(final[f"{t.name}.sum"], ref_state[t.name], rtol=1e-5, atol=1e-7)
        if kind == "adagrad":
            ref_sum = ref_opt.state[ref_tables[t.name].weight]["sum"]
            torch.testing.assert_close(final[f"{t.name}.sum"], ref_sum, rtol=1e-5, atol=1e-7)
    # Some batch looks a row up more than once (gradients summed before the update).
    assert any(kjt["d"].values().unique().numel() < kjt["d"].values().numel() for kjt in kjts)
    # Untouched rows never move (lazy updates).
    touched_any = {t.name: torch.zeros(t.rows, dtype=torch.bool) for t in tables}
    for kjt in kjts:
        for f in coll.features:
            touched_any[table_of[f]][kjt[f].values()] = True
    for t in tables:
        untouched = ~touched_any[t.name]
        assert torch.equal(final[f"{t.name}.weight"][untouched], start[f"{t.name}.weight"][untouched])


def test_optimizer_state_is_per_row() -> None:
    assert RowWiseAdagrad().state_bytes_per_row(64) == 4
    assert SparseAdagrad().state_bytes_per_row(64) == 64 * 4
    assert SparseAdam().state_bytes_per_row(64) == 2 * 64 * 4
    assert SparseSGD().state_bytes_per_row(64) == 0


def test_import_export_roundtrip() -> None:
    a = LocalEmbeddingCollection(tables_fixture(), make_sparse_optimizer("adam"), seed=1)
    b = LocalEmbeddingCollection(tables_fixture(), make_sparse_optimizer("adam"), seed=2)
    assert not torch.equal(a.weight, b.weight)
    b.import_tables({k: v.clone() for k, v in a.export_tables().items()})
    assert torch.equal(a.weight, b.weight)


def test_init_rows_slices_equal_the_full_table() -> None:
    from embeddings.init import INIT_BLOCK_ROWS, init_rows

    rows = 2 * INIT_BLOCK_ROWS + 123
    full = init_rows("t", rows, 8, seed=3)
    bound = (1.0 / rows) ** 0.5
    assert full.abs().max() <= bound and full.std() > bound / 3
    for r0, r1, c0, c1 in [(0, rows, 0, 8), (5, INIT_BLOCK_ROWS + 7, 2, 5), (rows - 1, rows, 7, 8)]:
        assert torch.equal(init_rows("t", rows, 8, 3, r0, r1, c0, c1), full[r0:r1, c0:c1])
    assert not torch.equal(init_rows("u", rows, 8, 3), full)
    assert not torch.equal(init_rows("t", rows, 8, 4), full)


def test_init_rows_into_a_view_equals_the_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``out=``: written in place into a weight's rows (fp32 directly; bf16 staged on the
    host in cuts of STAGE_ROWS, made small here so a slice spans several), the same
    values as the slice made on its own (bf16: rounded to nearest, as a copy does)."""
    from embeddings import init

    monkeypatch.setattr(init, "STAGE_ROWS", 2 * init.INIT_BLOCK_ROWS)
    rows = 5 * init.INIT_BLOCK_ROWS + 11
    full = init.init_rows("t", rows, 8, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.full((rows + 10, 8), 7.0, dtype=dtype)
        r0, r1 = 3, rows - 2
        got = init.init_rows("t", rows, 8, 3, r0, r1, 1, 6, out=weight[5:5 + r1 - r0, 2:7])
        assert torch.equal(got, full[r0:r1, 1:6].to(dtype))
        assert torch.equal(weight[5:5 + r1 - r0, 2:7], full[r0:r1, 1:6].to(dtype))
        assert (weight[:5] == 7).all() and (weight[5 + r1 - r0:] == 7).all() and (weight[:, :2] == 7).all()
    with pytest.raises(ValueError, match="slice"):
        init.init_rows("t", rows, 8, 3, 0, 10, out=torch.empty(9, 8))


_PEAK_SCRIPT = """
import torch, pathlib
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec

def status(key):
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

rows, dim = 800_000, 64
LocalEmbeddingCollection([TableSpec("small", rows=10, dim=dim, features=("a",))],
                         make_sparse_optimizer("rowwise_adagrad"), seed=0)  # the lazy imports
pathlib.Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
before = status("VmRSS")
c = LocalEmbeddingCollection([TableSpec("big", rows=rows, dim=dim, features=("a",))],
                             make_sparse_optimizer("rowwise_adagrad"), seed=0)
print((status("VmHWM") - before) / (rows * dim * 4))
"""


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/clear_refs").exists(),
                    reason="needs Linux's peak-RSS reset")
def test_a_table_is_built_without_a_second_copy_of_it() -> None:
    """A table near the memory size must fit: the peak memory of building a collection
    (init included) is about the table, not twice it (the init once made the whole
    slice, then copied it in). A fresh process, its peak RSS reset after the imports."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True,
                         check=True, cwd=__import__("pathlib").Path(__file__).parents[1])
    peak_over_table = float(out.stdout.split()[-1])
    assert 0.95 < peak_over_table < 1.25, peak_over_table


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_init_state_follows_the_declared_layout(kind: str) -> None:
    from embeddings.optim import StateKind

    opt = make_sparse_optimizer(kind)
    state = opt.init_state(5, 3, torch.device("cpu"))
    layout = opt.state_layout()
    assert list(state) == list(layout)
    shapes = {StateKind.ROW_VECTOR: (5, 3), StateKind.ROW_SCALAR: (5,), StateKind.TABLE_SCALAR: (1,)}
    for name, spec in layout.items():
        assert tuple(state[name].shape) == shapes[spec.kind] and state[name].dtype == spec.dtype
        assert not state[name].any()
    assert opt.per_row_state() == [n for n, s in layout.items() if s.kind is not StateKind.TABLE_SCALAR]


@pytest.mark.parametrize("fbgemm", [True, False])
def test_in_feature_order_equals_kjt_permute(fbgemm: bool, monkeypatch) -> None:
    """The reorder (with fbgemm, and with its plain-torch fallback) equals KJT.permute;
    stacked ids are shifted by each feature's table offset."""
    pytest.importorskip("torchrec")
    from embeddings import jagged

    if fbgemm:
        pytest.importorskip("fbgemm_gpu")
        assert jagged._fbgemm_ops()
    else:
        monkeypatch.setattr(jagged, "_fbgemm_ops", lambda: False)
    kjt = random_kjt(["c", "a", "b"], {"a": 9, "b": 9, "c": 9}, batch=5, max_len=3, seed=4)
    values, lengths, batch = jagged.in_feature_order(kjt, ["a", "b", "c"])
    want = kjt.to_kjt().permute([1, 2, 0])
    assert batch == 5
    assert torch.equal(values, want.values()) and torch.equal(lengths, want.lengths())
    ids = jagged.stacked_ids(values, lengths, torch.tensor([0, 100, 200]), batch)
    per_feature = want.length_per_key()
    shift = torch.repeat_interleave(torch.tensor([0, 100, 200]), torch.tensor(per_feature))
    assert torch.equal(ids, values + shift)
    empty = random_kjt(["c", "a", "b"], {"a": 9, "b": 9, "c": 9}, batch=0, max_len=3, seed=4)
    values, lengths, batch = jagged.in_feature_order(empty, ["a", "b", "c"])
    assert batch == 0 and values.numel() == 0 and lengths.numel() == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_an_empty_step_only_counts(kind: str, dtype: str) -> None:
    """``apply_gradient`` of no rows skips the optimizer's ops on no rows: the state
    after it, and after a real step that follows (Adam's bias correction, a half
    table's rounding step), equals the optimizer applied to the empty gradient; and
    ``counts_steps`` says whether an empty step changes anything at all."""
    tables = [dataclass_replace(t, dtype=dtype) for t in tables_fixture()]
    made = [LocalEmbeddingCollection(tables, make_sparse_optimizer(kind, state_dtype=dtype), fused=True, seed=3,
                                     rounding_seed=7) for _ in range(2)]
    for coll in made:
        coll.set_lr(0.05)
    short, ref = made
    empty = KVGradient.empty(short.dim, short.weight.device)
    short.apply_gradient(empty)
    # the reference: what apply_gradient did before it looked at the gradient's size
    if ref.optimizer.rounding:
        ref.state["rounding_step"] += 1
    ref.optimizer.apply(ref.weight.data, ref.state, empty, ref.lr)
    before = {k: v.clone() for k, v in made[0].export_tables().items()}
    for coll in made:
        assert all(torch.equal(v, before[k]) for k, v in coll.export_tables().items())
    ids = torch.tensor([0, 3, 40, 55, 80])
    rows = torch.randn(5, short.dim, generator=torch.Generator().manual_seed(1))
    for coll in made:
        coll.apply_gradient(KVGradient(ids, rows.clone()))
    after = [coll.export_tables() for coll in made]
    assert after[0].keys() == after[1].keys()
    for key in after[0]:
        assert torch.equal(after[0][key], after[1][key]), key
    assert any(not torch.equal(after[0][k], before[k]) for k in before if k.endswith(".weight"))
    changes = any(not torch.equal(a, b) for a, b in zip(before.values(),
                  LocalEmbeddingCollection(tables, make_sparse_optimizer(kind, state_dtype=dtype), fused=True,
                                           seed=3, rounding_seed=7).export_tables().values()))
    assert short.optimizer.counts_steps() == changes == (kind == "adam" or dtype != "fp32")
