"""A Hotline step's ops do not grow with the number of tables.

Every per-table quantity the step needs (each bag's table offset, each feature's row
base) is a tensor over all tables, so one op covers them all: a step of 26 tables
issues exactly the ops a step of 4 does (``dlrm/train/sync_audit.py`` counts them; on
a GPU each is a launch, a loop over tables would be 26). The step audited is the
trainer's, on the Triton path (interpreted on CPU): the mini-batch split on the
device, its header read, both micro-batches (the popular one hot only, the other
with its gathered cold rows) forward and backward, and the kept update.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE  # sets TRITON_INTERPRET=1 without a GPU

pytest.importorskip("triton")

from data.jagged import JaggedFeatures
from dlrm.train.sync_audit import SyncAudit
from embeddings.hotline.lookups import HOT_ONLY
from embeddings.hotline.split import Sizes
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.interface import Prefetched
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling, TableSpec
from tests.test_hotline import profile_of

pytestmark = pytest.mark.kernels
ROWS, BATCH, POPULAR = 20, 8, 5  # row 0 of every table cold; samples 0..4 all hot


def audited_step(tables: int, pooling: Pooling) -> tuple[SyncAudit, Sizes]:
    """One kept step of a collection of ``tables`` one-feature tables: samples under
    POPULAR look up hot rows only, the others row 0 (cold) of feature 0."""
    specs = [TableSpec(f"t{i}", rows=ROWS, dim=4, features=(f"f{i}",), pooling=pooling) for i in range(tables)]
    hot = {t.name: torch.arange(1, ROWS) for t in specs}
    coll = HotlineEmbeddingCollection(specs, profile_of(specs, hot), make_sparse_optimizer("adagrad"),
                                      fused=False, device=DEVICE, kernels="triton")
    lengths = torch.randint(1, 3, (tables * BATCH,), generator=torch.Generator().manual_seed(tables))
    values = 1 + torch.arange(int(lengths.sum())) % (ROWS - 1)
    values[int(lengths[:POPULAR].sum()):int(lengths[:BATCH].sum())] = 0  # feature 0, samples POPULAR..
    kjt = JaggedFeatures(keys=[t.features[0] for t in specs], values=values, lengths=lengths).to(DEVICE)
    coll.set_lr(0.1)
    with SyncAudit() as audit:
        split = coll.split_on_device(kjt)
        sizes = Sizes.read(split.header)
        popular, rest = (coll.micro_batch(split, sizes, g) for g in (0, 1))
        for micro, cold in ((popular, HOT_ONLY), (rest, coll.gather_cold(rest))):
            coll(Prefetched(micro, cold)).square().sum().backward()
        coll.step()
    return audit, sizes


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN])
def test_ops_per_step_do_not_grow_with_tables(pooling: Pooling) -> None:
    (few, few_sizes), (many, many_sizes) = audited_step(4, pooling), audited_step(26, pooling)
    for sizes in (few_sizes, many_sizes):  # both micro-batches ran, with hot and cold lookups
        assert sizes.group0 == sizes.popular == POPULAR and sizes.hot1 > 0 and sizes.unique_cold == 1
    assert few.violations == [] and many.violations == []
    assert many.compute_ops == few.compute_ops, (dict(few.ops), dict(many.ops))
    assert many.ops["triton._pooled_kernel"] == 2 and many.ops["triton._runs_kernel"] == 1
