"""The device classification (embeddings/hotline/split.py) equals a plain-Python count.

Random mini-batches (multi-hot bags, empty bags, a table shared by two features, hot
sets from none to all of the rows): per lookup hot or cold and its slot; per sample
popular or not; the header's sizes; the unique cold ids; and each micro-batch's
lookups, bag by bag (hot slots, cold ids, lengths, mean-pooling scales), with the
popularity split and without it.
"""

from __future__ import annotations

import pytest
import torch

from data.jagged import JaggedFeatures
from embeddings.hotline.split import Sizes, micro_lookups, samples_of
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, profile_of, rows_of


def reference(coll: HotlineEmbeddingCollection, kjt: JaggedFeatures, hot: set[int]) -> dict:
    """Python lists: bags[s][f] = the stacked ids of feature f in sample s."""
    table_of = {f: t.name for t in coll.tables for f in t.features}
    batch = kjt.stride()
    bags = [[[] for _ in FEATURES] for _ in range(batch)]
    for fi, f in enumerate(FEATURES):
        jt = kjt[f]
        for s, ids in enumerate(jt.values().split(jt.lengths().tolist())):
            bags[s][fi] = [i + coll.row_offsets[table_of[f]] for i in ids.tolist()]
    popular = [all(i in hot for bag in sample for i in bag) for sample in bags]
    cold = sorted({i for sample in bags for bag in sample for i in bag if i not in hot})
    return {"bags": bags, "popular": popular, "cold": cold}


def assert_micro(micro, samples: list[int], ref: dict, hot_ids: list[int], mean: bool) -> None:
    """``micro``'s bags (feature-major over ``samples``) are the reference's, split hot/cold."""
    bags = ref["bags"]
    want_hot, want_cold, want_len, hot_len, cold_len = [], [], [], [], []
    for fi in range(len(FEATURES)):
        for s in samples:
            bag = bags[s][fi]
            hot = [hot_ids.index(i) for i in bag if i in hot_ids]
            cold = [i for i in bag if i not in hot_ids]
            want_hot += hot
            want_cold += cold
            want_len.append(len(bag))
            hot_len.append(len(hot))
            cold_len.append(len(cold))
    assert micro.batch == len(samples)
    assert micro.hot_slots.tolist() == want_hot
    assert micro.cold_ids[micro.cold_local].tolist() == want_cold
    assert micro.lengths.tolist() == want_len
    assert micro.hot_lengths.tolist() == hot_len and micro.cold_lengths.tolist() == cold_len
    if mean:
        per_id = [1.0 / max(n, 1) for n, k in zip(want_len, hot_len) for _ in range(k)]
        torch.testing.assert_close(micro.hot_scale, torch.tensor(per_id), rtol=0, atol=0)
    else:
        assert micro.hot_scale is None and micro.cold_scale is None


@pytest.mark.parametrize("share", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_split_equals_a_python_count(share: float, seed: int) -> None:
    pooling = Pooling.MEAN if seed % 2 else Pooling.SUM
    tables = tables_fixture(pooling)
    g = torch.Generator().manual_seed(100 + seed)
    hot_rows = {t.name: torch.nonzero(torch.rand(t.rows, generator=g) < share).flatten() for t in tables}
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, hot_rows), make_sparse_optimizer("sgd"))
    hot_ids = coll.hot_ids.tolist()
    kjt = random_kjt(FEATURES, rows_of(tables), batch=9, max_len=3, seed=seed)
    ref = reference(coll, kjt, set(hot_ids))

    split = coll.split_on_device(kjt)
    sizes = Sizes.read(split.header)
    stacked = [i for fi in range(len(FEATURES)) for sample in ref["bags"] for i in sample[fi]]
    assert split.lookups.ids.tolist() == stacked
    assert split.lookups.is_hot.tolist() == [i in hot_ids for i in stacked]
    hot_slot = [s for s, h in zip(split.lookups.slot.tolist(), split.lookups.is_hot.tolist()) if h]
    assert hot_slot == [hot_ids.index(i) for i in stacked if i in hot_ids]
    assert (split.group == 0).tolist() == ref["popular"]
    assert coll.split(kjt).tolist() == ref["popular"]
    assert sizes.popular == sizes.group0 == sum(ref["popular"])
    assert sizes.unique_cold == len(ref["cold"])
    assert split.unique_cold[:sizes.unique_cold].tolist() == ref["cold"]
    assert sizes.cold0 == 0  # a popular sample has no cold lookup
    assert sizes.hot0 + sizes.hot1 == sum(i in hot_ids for i in stacked)
    assert sizes.hot0 + sizes.cold0 + sizes.hot1 + sizes.cold1 == len(stacked)

    popular = [s for s, p in enumerate(ref["popular"]) if p]
    rest = [s for s, p in enumerate(ref["popular"]) if not p]
    for group, samples in ((0, popular), (1, rest)):
        assert samples_of(split, sizes, group).tolist() == samples
        micro = micro_lookups(split, sizes, group)
        assert_micro(micro, samples, ref, hot_ids, pooling is Pooling.MEAN)
        assert micro.popular == (len(samples) if group == 0 else 0)

    whole_split = coll.split_on_device(kjt, by_popularity=False)
    whole_sizes = Sizes.read(whole_split.header)
    assert whole_sizes.group0 == 9 and whole_sizes.hot1 == whole_sizes.cold1 == 0
    whole = micro_lookups(whole_split, whole_sizes, 0)
    assert_micro(whole, list(range(9)), ref, hot_ids, pooling is Pooling.MEAN)
    assert whole.popular == sum(ref["popular"])


def test_a_batch_without_lookups() -> None:
    tables = tables_fixture()
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, {"t0": torch.tensor([1])}),
                                      make_sparse_optimizer("sgd"))
    kjt = JaggedFeatures(keys=FEATURES, values=torch.zeros(0, dtype=torch.int64),
                         lengths=torch.zeros(4 * 3, dtype=torch.int64))
    split = coll.split_on_device(kjt)
    sizes = Sizes.read(split.header)
    assert sizes == Sizes(group0=3, hot0=0, cold0=0, hot1=0, cold1=0, unique_cold=0, popular=3)
    micro = micro_lookups(split, sizes, 0)
    assert micro.batch == 3 and micro.lookups == 0 and micro.lengths.tolist() == [0] * 12
