"""The Hotline hot tier on the Triton kernels equals it on torch (Triton's interpreter on CPU).

A mini-batch classified on the device, its popular then its non-popular micro-batch
(forward, backward), one step: with ``kernels=triton`` the hot lookups of each
micro-batch are one ``_pooled_kernel`` launch and the step's hot update is ONE
``_runs_kernel`` launch (one sort) for both; the tables, the hot tier's state and
the host tier equal the torch path's for every optimizer, sum and mean pooling, kept
and fused; the Triton path's micro-batches and step issue no sync at all; and the trainer on
that path equals ordinary training.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.kernel_cases import DEVICE  # sets TRITON_INTERPRET=1 without a GPU

pytest.importorskip("triton")

from dlrm.train.sync_audit import SyncAudit
from embeddings.hotline.lookups import HOT_ONLY
from embeddings.hotline.split import Sizes
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.interface import Prefetched
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling
from tests.conftest import FEW_TABLES
from tests.run_state import RTOL, assert_states_close, run_state
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, LR, assert_same_tables, profile_of, rows_of, touched
from tests.test_hotline_train import HOTLINE, run

pytestmark = pytest.mark.kernels
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def make(kernels: str, kind: str, pooling: Pooling, fused: bool, kjts) -> HotlineEmbeddingCollection:
    tables = tables_fixture(pooling)
    hot = {name: ids[ids % 3 != 0] for name, ids in touched(tables, kjts).items()}
    return HotlineEmbeddingCollection(tables, profile_of(tables, hot), make_sparse_optimizer(kind),
                                      fused=fused, seed=4, device=DEVICE, kernels=kernels)


def train_step(coll: HotlineEmbeddingCollection, kjt, up: torch.Tensor) -> SyncAudit:
    """One mini-batch as the trainer runs it; the audit of its micro-batches and step."""
    coll.set_lr(LR)
    kjt = kjt.to(device=DEVICE)
    split = coll.split_on_device(kjt)
    sizes = Sizes.read(split.header)
    parts = [(coll.micro_batch(split, sizes, g), g) for g in (0, 1)]
    colds = [HOT_ONLY, coll.gather_cold(parts[1][0])]
    with SyncAudit() as audit:
        for (micro, group), cold in zip(parts, colds):
            rows = (split.sample_order[:sizes.group0] if group == 0 else split.sample_order[sizes.group0:])
            (coll(Prefetched(micro, cold)) * up.to(DEVICE).index_select(0, rows)).sum().backward()
        coll.step()
    return audit


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_triton_hot_tier_equals_torch(kind: str, pooling: Pooling) -> None:
    kjts = [random_kjt(FEATURES, rows_of(tables_fixture()), batch=12, max_len=3, seed=s) for s in range(3)]
    ups = [torch.randn(12, 16, generator=torch.Generator().manual_seed(20 + s)) for s in range(3)]
    torch_path = make("torch", kind, pooling, False, kjts)
    triton_path = make("triton", kind, pooling, False, kjts)
    assert triton_path.hot.on_triton() and not torch_path.hot.on_triton()
    for kjt, up in zip(kjts, ups):
        train_step(torch_path, kjt, up)
        audit = train_step(triton_path, kjt, up)
        assert audit.violations == [], audit.violations
        if INTERPRETED:  # launches are counted where the interpreter runs them
            assert audit.ops["triton._pooled_kernel"] == 2  # the hot side of each micro-batch
            assert audit.ops["triton._runs_kernel"] == 1  # one fused backward + update for both
    torch.testing.assert_close(triton_path.hot_weight.detach(), torch_path.hot_weight.detach(),
                               rtol=1e-5, atol=1e-6)
    for name, value in torch_path.hot_state.items():
        torch.testing.assert_close(triton_path.hot_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert_same_tables(triton_path.export_tables(), torch_path.export_tables())


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_fused_triton_hot_tier_equals_torch(kind: str) -> None:
    """Fused (the update in each backward), a whole batch at a time (cold rows inline)."""
    kjts = [random_kjt(FEATURES, rows_of(tables_fixture()), batch=8, max_len=2, seed=s) for s in range(3)]
    paths = [make(k, kind, Pooling.MEAN, True, kjts) for k in ("torch", "triton")]
    for s, kjt in enumerate(kjts):
        up = torch.randn(8, 16, generator=torch.Generator().manual_seed(s)).to(DEVICE)
        for coll in paths:
            coll.set_lr(LR)
            (coll(kjt.to(device=DEVICE)) * up).sum().backward()
    assert_same_tables(paths[1].export_tables(), paths[0].export_tables())


def test_held_gradients_are_the_kv_gradients_of_the_torch_path() -> None:
    kjts = [random_kjt(FEATURES, rows_of(tables_fixture()), batch=12, max_len=3, seed=5)]
    paths = [make(k, "sgd", Pooling.SUM, False, kjts) for k in ("torch", "triton")]
    assert_held_kv_gradients_equal(paths, kjts[0], 12)


def assert_held_kv_gradients_equal(paths: list, kjt, batch: int) -> None:
    """Both micro-batches of ``kjt`` kept by each of (torch path, Triton path): the
    Triton path's ``kv_gradients`` (by stacked id) equal the torch path's."""
    up = torch.randn(batch, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for coll in paths:
        on_device = kjt.to(device=DEVICE)
        popular = coll.split(on_device)
        for mask in (popular, ~popular):
            rows = mask.nonzero().flatten()
            (coll(on_device.select(rows)) * up[rows]).sum().backward()
    want, got = paths[0].kv_gradients(), paths[1].kv_gradients()
    assert sorted(got) == sorted(want) and want
    for name in want:
        assert torch.equal(got[name].ids.cpu(), want[name].ids.cpu()), name
        torch.testing.assert_close(got[name].rows.cpu(), want[name].rows.cpu(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_hotline_on_the_triton_kernels_equals_ordinary_training(tiny_data, tmp_path: Path) -> None:
    """The trainer with the hot tier on the Triton kernels (as on a GPU by default)
    against ordinary training."""
    triton = ("embeddings.kernels=triton", "optim.sparse=adam", "train.max_steps=3", "data.batch_size=64",
              FEW_TABLES)
    run(tiny_data, tmp_path / "plain", *triton[1:])
    summary = run(tiny_data, tmp_path / "hot", *triton, *HOTLINE, "hotline.budget=300KB")  # of 8 x 64 KB
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), "hotline triton",
                        RTOL.get("adam", 1e-5))
    assert 0.0 < summary["hotline"]["popular_share"] < 1.0
    assert summary["hotline"]["hot_tier_triton"] == 1.0
