"""Hotline tiers equal the single-process collection: every optimizer, fused and
kept, hot sets of none / half / all touched rows, with a refresh mid-training;
plus the profile (counts, budgeted ranking, save/load, hit rate) and split()."""

from __future__ import annotations

import pytest
import torch

from data.jagged import JaggedFeatures
from embeddings.collection import LocalEmbeddingCollection
from embeddings.hotline.profile import HotProfile, choose_hot_rows, count_accesses, row_bytes
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.interface import Prefetched
from embeddings.optim import SparseAdam, make_sparse_optimizer
from embeddings.table import Pooling, TableSpec
from tests.test_embeddings import random_kjt, tables_fixture

FEATURES = ["a", "b", "c", "d"]
LR = 0.1


def rows_of(tables: list[TableSpec]) -> dict[str, int]:
    return {f: t.rows for t in tables for f in t.features}


def touched(tables: list[TableSpec], kjts: list[JaggedFeatures]) -> dict[str, torch.Tensor]:
    table_of = {f: t.name for t in tables for f in t.features}
    parts: dict[str, list[torch.Tensor]] = {t.name: [] for t in tables}
    for kjt in kjts:
        for f, jt in kjt.to_dict().items():
            parts[table_of[f]].append(jt.values())
    return {name: torch.unique(torch.cat(p)) for name, p in parts.items()}


def profile_of(tables: list[TableSpec], hot: dict[str, torch.Tensor]) -> HotProfile:
    return HotProfile(hot, {f: t.name for t in tables for f in t.features}, budget_bytes=0)


def hot_sets(tables, kjts, share: str, phase: int) -> dict[str, torch.Tensor]:
    """none / half (even or odd positions of the touched rows, by phase) / all."""
    out = {}
    for name, ids in touched(tables, kjts).items():
        if share == "none":
            out[name] = ids[:0]
        elif share == "all":
            out[name] = ids
        else:
            out[name] = ids[phase % 2 :: 2]
    return out


def assert_same_tables(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("refresh", [False, True])
@pytest.mark.parametrize("share", ["none", "half", "all"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_hotline_equals_local_collection(kind: str, fused: bool, share: str, refresh: bool) -> None:
    steps = 4
    pooling = Pooling.MEAN if kind == "rowwise_adagrad" else Pooling.SUM
    tables = tables_fixture(pooling)
    # Single-hot batches first, multi-hot after.
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=6, max_len=1 if s < 2 else 3, seed=s)
            for s in range(steps)]
    ups = [torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]
    ref = LocalEmbeddingCollection(tables, make_sparse_optimizer(kind), fused=fused, seed=5)
    hot = HotlineEmbeddingCollection(
        tables, profile_of(tables, hot_sets(tables, kjts, share, 0)), make_sparse_optimizer(kind),
        fused=fused, seed=5,
    )
    assert_same_tables(hot.export_tables(), ref.export_tables())
    for s, (kjt, up) in enumerate(zip(kjts, ups)):
        if refresh and s == steps // 2:
            before = {k: v.clone() for k, v in hot.export_tables().items()}
            # Always a different set: the other half of the touched rows.
            hot.refresh(profile_of(tables, hot_sets(tables, kjts, "half", 1)))
            assert_same_tables(hot.export_tables(), before)
        for coll in (ref, hot):
            coll.set_lr(LR)
            out = coll(kjt)
            (out * up).sum().backward()
        if not fused:
            want, got = ref.kv_gradients(), hot.kv_gradients()
            assert sorted(got) == sorted(want)
            for name, g in want.items():
                assert torch.equal(got[name].ids, g.ids)
                torch.testing.assert_close(got[name].rows, g.rows)
        ref.step()
        hot.step()
        assert hot.last_stats["hot_hit_rate"] == pytest.approx(hot.profile.hit_rate(kjt))
    assert_same_tables(hot.export_tables(), ref.export_tables())
    if kind == "adam":
        assert int(hot.hot_state["step"]) == int(hot.host.state["step"]) == steps


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad", "adam"])
def test_popular_then_non_popular_micro_batches_equal_one_step(kind: str) -> None:
    tables = tables_fixture()
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=16, max_len=2, seed=s) for s in range(3)]
    ups = [torch.randn(16, 16, generator=torch.Generator().manual_seed(7 + s)) for s in range(3)]
    # Hot: the rows most used in the data, so some samples are popular and some not.
    counts = count_accesses(kjts, tables)
    budget = 40 * row_bytes(tables[0], make_sparse_optimizer(kind))
    profile = HotProfile.build(counts, tables, make_sparse_optimizer(kind), budget)
    ref = LocalEmbeddingCollection(tables, make_sparse_optimizer(kind), fused=False, seed=2)
    hot = HotlineEmbeddingCollection(tables, profile, make_sparse_optimizer(kind), fused=False, seed=2)
    shares = []
    for kjt, up in zip(kjts, ups):
        ref.set_lr(LR)
        (ref(kjt) * up).sum().backward()
        ref.step()
        hot.set_lr(LR)
        popular = hot.split(kjt)
        shares.append(float(popular.float().mean()))
        for mask in (popular, ~popular):
            part = select(kjt, mask)
            (hot(part) * up[mask]).sum().backward()
        hot.step()
    assert 0 < min(shares) and max(shares) < 1
    assert_same_tables(hot.export_tables(), ref.export_tables())


def select(kjt: JaggedFeatures, mask: torch.Tensor) -> JaggedFeatures:
    """The samples of ``kjt`` where ``mask`` holds, every feature."""
    lengths, values = [], []
    for f in kjt.keys():  # noqa: SIM118 (not a dict)
        jt = kjt[f]
        keep = torch.repeat_interleave(mask, jt.lengths())
        lengths.append(jt.lengths()[mask])
        values.append(jt.values()[keep])
    return JaggedFeatures(keys=kjt.keys(), values=torch.cat(values), lengths=torch.cat(lengths),
                          stride=int(mask.sum()))


def test_split_and_hit_rate_match_a_hand_count() -> None:
    tables = tables_fixture()
    kjt = random_kjt(FEATURES, rows_of(tables), batch=12, max_len=3, seed=9)
    hot = {"t0": torch.arange(0, 50, 3), "t_shared": torch.arange(0, 30, 2), "t2": torch.tensor([1, 5])}
    profile = profile_of(tables, hot)
    coll = HotlineEmbeddingCollection(tables, profile, make_sparse_optimizer("sgd"))
    table_of = {f: t.name for t in tables for f in t.features}
    popular, hits, total = [True] * 12, 0, 0
    for f in FEATURES:
        jt = kjt[f]
        for b, ids in enumerate(jt.values().split(jt.lengths().tolist())):
            for i in ids.tolist():
                is_hot = i in set(hot[table_of[f]].tolist())
                hits += is_hot
                total += 1
                popular[b] = popular[b] and is_hot
    assert coll.split(kjt).tolist() == popular
    assert 0 < sum(popular) < 12
    assert profile.hit_rate(kjt) == pytest.approx(hits / total)
    coll(kjt)
    assert coll.last_stats["hot_hit_rate"] == pytest.approx(hits / total)
    assert coll.last_stats["popular_share"] == pytest.approx(sum(popular) / 12)


def test_count_accesses_adds_shared_features_and_stops() -> None:
    tables = tables_fixture()
    kjt = JaggedFeatures(keys=FEATURES, values=torch.tensor([3, 3, 1, 1, 2, 6]),
                         lengths=torch.tensor([2, 0, 1, 1, 1, 0, 0, 1]))
    counts = count_accesses([kjt, kjt, kjt], tables, max_batches=2)
    assert counts["t0"][3] == 4 and counts["t0"].sum() == 4
    assert counts["t_shared"][1] == 4 and counts["t_shared"][2] == 2 and counts["t_shared"].sum() == 6
    assert counts["t2"][6] == 2 and counts["t2"].sum() == 2


def test_counts_equal_bincount() -> None:
    """Batches of several features, two sharing a table, counted as a bincount of each
    feature's ids into its table would count them."""
    tables = tables_fixture()
    gen = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(3):
        lengths = torch.randint(0, 4, (len(FEATURES) * 2,), generator=gen)
        by_feature = [FEATURES[i // 2] for i in range(len(lengths))]
        rows = {t.name: t.rows for t in tables}
        table = {f: t.name for t in tables for f in t.features}
        values = torch.cat([torch.randint(0, rows[table[f]], (int(n),), generator=gen)
                            for f, n in zip(by_feature, lengths, strict=True)])
        batches.append(JaggedFeatures(keys=FEATURES, values=values, lengths=lengths))
    again = count_accesses(batches, tables)
    want = {t.name: torch.zeros(t.rows, dtype=torch.int64) for t in tables}
    for kjt in batches:
        for f, jt in kjt.to_dict().items():
            name = next(t.name for t in tables if f in t.features)
            want[name] += torch.bincount(jt.values(), minlength=want[name].numel())
    assert all(torch.equal(again[k], want[k]) for k in want)


def test_choose_hot_rows_equals_a_ranking_of_every_row() -> None:
    """Ranking only the rows seen equals ranking every row of every table by (count
    desc, table order, row id) and taking them while the budget holds (ties included);
    once every seen row is taken, the unseen ones by (table rows, table order, row id),
    each while it fits."""
    tables = tables_fixture()
    opt = SparseAdam()
    gen = torch.Generator().manual_seed(9)
    counts = {t.name: torch.randint(0, 4, (t.rows,), generator=gen) * torch.randint(0, 2, (t.rows,), generator=gen)
              for t in tables}
    ranked = sorted(((-int(c), i, r) for i, t in enumerate(tables) for r, c in enumerate(counts[t.name].tolist())
                     if c > 0))
    unseen = sorted((t.rows, i, r) for i, t in enumerate(tables) for r, c in enumerate(counts[t.name].tolist())
                    if c == 0)
    seen_bytes = sum(row_bytes(tables[i], opt) for _, i, _ in ranked)
    for budget in (0, 100, 1000, 3000, seen_bytes - 1, seen_bytes, seen_bytes + 500, 10**9):
        want, used = {t.name: [] for t in tables}, 0
        for _, i, r in ranked:
            used += row_bytes(tables[i], opt)
            if used > budget:
                break
            want[tables[i].name].append(r)
        if used <= budget:  # every seen row taken: the room left takes unseen ones
            for _, i, r in unseen:
                if used + row_bytes(tables[i], opt) <= budget:
                    used += row_bytes(tables[i], opt)
                    want[tables[i].name].append(r)
        got = choose_hot_rows(counts, tables, opt, budget)
        assert {k: v.tolist() for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}, budget


def assert_rows(hot: dict[str, torch.Tensor], want: dict[str, list[int]]) -> bool:
    return {k: v.tolist() for k, v in hot.items()} == want


def test_choose_hot_rows_ranks_globally_within_budget() -> None:
    tables = tables_fixture()
    opt = SparseAdam()
    per_row = row_bytes(tables[0], opt)
    assert per_row == 4 * 4 + 2 * 4 * 4
    counts = {t.name: torch.zeros(t.rows, dtype=torch.int64) for t in tables}
    counts["t0"][[10, 20]] = torch.tensor([5, 1])
    counts["t_shared"][[4, 7]] = torch.tensor([9, 5])  # 7 ties t0's 10: t0 comes first
    counts["t2"][3] = 2
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=3 * per_row + per_row - 1)
    assert assert_rows(hot, {"t0": [10], "t_shared": [4, 7], "t2": []})
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=2 * per_row)
    assert assert_rows(hot, {"t0": [10], "t_shared": [4], "t2": []})
    # every counted row hot, room for 9 more: the smallest table (t2, 7 rows) whole, then
    # t_shared's (30 rows, before t0's 50) lowest unseen rows
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=(5 + 9) * per_row)
    assert assert_rows(hot, {"t0": [10, 20], "t_shared": [0, 1, 2, 4, 7], "t2": list(range(7))})
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=10**9)  # a budget over the tables: every row
    assert assert_rows(hot, {t.name: list(range(t.rows)) for t in tables})
    assert all(v.dtype == torch.int64 for v in hot.values())
    assert assert_rows(choose_hot_rows(counts, tables, opt, 0), {"t0": [], "t_shared": [], "t2": []})


def test_kept_rows_fill_the_room_the_counted_rows_leave() -> None:
    """``keep`` (a refresh's hot rows now): after every counted row, whatever its
    count, in table and row order, within the budget; with no room, no kept row."""
    tables = tables_fixture()
    opt = SparseAdam()
    per_row = row_bytes(tables[0], opt)
    counts = {t.name: torch.zeros(t.rows, dtype=torch.int64) for t in tables}
    counts["t0"][10] = 1
    counts["t2"][3] = 7
    keep = {"t0": torch.tensor([2, 10]), "t_shared": torch.tensor([5, 1]), "t2": torch.tensor([6])}
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=4 * per_row, keep=keep)
    # counted: t2's 3 (7), t0's 10 (1, kept too); then kept unseen: t0's 2, t_shared's 1, 5, t2's 6
    assert assert_rows(hot, {"t0": [2, 10], "t_shared": [1], "t2": [3]})
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=6 * per_row, keep=keep)
    assert assert_rows(hot, {"t0": [2, 10], "t_shared": [1, 5], "t2": [3, 6]})
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=8 * per_row, keep=keep)  # then unseen rows
    assert assert_rows(hot, {"t0": [2, 10], "t_shared": [1, 5], "t2": [0, 1, 3, 6]})
    hot = choose_hot_rows(counts, tables, opt, budget_bytes=2 * per_row, keep=keep)
    alone = choose_hot_rows(counts, tables, opt, budget_bytes=2 * per_row)  # no room: as without keep
    assert assert_rows(hot, {k: v.tolist() for k, v in alone.items()})


def test_profile_save_load_roundtrip(tmp_path) -> None:
    tables = tables_fixture()
    counts = {t.name: torch.arange(t.rows, dtype=torch.int64) % 3 for t in tables}
    profile = HotProfile.build(counts, tables, make_sparse_optimizer("rowwise_adagrad"), 20 * 20)
    path = tmp_path / "hot.pt"
    profile.save(path)
    loaded = HotProfile.load(path)
    assert list(tmp_path.iterdir()) == [path]
    assert loaded.features == profile.features and loaded.budget_bytes == 400
    assert loaded.summary == profile.summary
    assert sum(s["hot_rows"] for s in loaded.summary.values()) == 20
    for name in profile.hot:
        assert torch.equal(loaded.hot[name], profile.hot[name])


def test_import_tables_reaches_the_hot_tier() -> None:
    tables = tables_fixture()
    src = LocalEmbeddingCollection(tables, make_sparse_optimizer("adam"), seed=1)
    hot = {"t0": torch.tensor([0, 4]), "t_shared": torch.tensor([2]), "t2": torch.tensor([6])}
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, hot), make_sparse_optimizer("adam"), seed=2)
    coll.import_tables({k: v.clone() for k, v in src.export_tables().items()})
    assert torch.equal(coll.hot_weight[0], src.weight[0]) and torch.equal(coll.hot_weight[3], src.weight[50 + 30 + 6])
    assert_same_tables(coll.export_tables(), src.export_tables())


def test_cold_rows_gathered_ahead_and_checked() -> None:
    tables = tables_fixture()
    a, b = (random_kjt(FEATURES, rows_of(tables), batch=5, max_len=2, seed=s) for s in (1, 2))
    hot = {"t0": torch.arange(0, 50, 2), "t_shared": torch.arange(0, 30, 2), "t2": torch.tensor([0])}
    coll = HotlineEmbeddingCollection(tables, profile_of(tables, hot), make_sparse_optimizer("sgd"))
    cold = coll.gather_cold(a)
    assert torch.equal(coll(Prefetched(a, cold)), coll(a))
    assert coll.last_stats["cold_rows"] == cold.ids.numel() > 0
    with pytest.raises(ValueError, match="another batch"):
        coll(Prefetched(b, cold))


class _HotGreedySGD(type(make_sparse_optimizer("sgd"))):
    """SGD whose state for exactly 7 rows (the hot tier below) is more than any machine has."""

    def init_state(self, rows: int, dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"waste": torch.zeros(rows << 40, device=device)} if rows == 7 else {}


def test_hot_tier_out_of_memory_is_one_line_naming_it() -> None:
    from embeddings.collection import AllocationError

    tables = [TableSpec("t", rows=100, dim=4, features=("a",))]
    profile = profile_of(tables, {"t": torch.arange(7)})
    with pytest.raises(AllocationError, match=r"out of memory allocating the Hotline hot tier "
                                              r"\(7 rows x 4 with _HotGreedySGD state; see hotline.budget\)"):
        HotlineEmbeddingCollection(tables, profile, _HotGreedySGD())


def test_both_host_tiers_implement_the_interface() -> None:
    from embeddings.hotline.host_local import LocalHostTier
    from embeddings.hotline.host_sharded import ShardedHostTier
    from embeddings.hotline.host_tier import HostTier

    methods = [n for n, v in vars(HostTier).items() if callable(v) and not n.startswith("_")]
    assert {"read_rows", "write_rows", "gather_cold", "pool", "step"} <= set(methods)
    for tier in (LocalHostTier, ShardedHostTier):
        assert [n for n in methods if not callable(getattr(tier, n, None))] == [], tier


def test_hot_rows_are_the_hot_sets_per_table() -> None:
    """``hot_rows`` (a refresh's ``keep``) gives back each table's hot rows as the
    profile chose them, tables empty, whole or cut at either end included."""
    gen = torch.Generator().manual_seed(3)
    tables = [TableSpec(f"t{i}", rows=r, dim=4, features=(f"f{i}",)) for i, r in enumerate([5, 40, 1, 300, 7])]
    for _ in range(20):
        hot = {}
        for t in tables:
            keep = torch.rand(t.rows, generator=gen) < float(torch.rand(1, generator=gen))
            hot[t.name] = torch.nonzero(keep).flatten()
        coll = HotlineEmbeddingCollection(tables, profile_of(tables, hot), make_sparse_optimizer("sgd"), seed=0)
        got = coll.hot_rows()
        assert list(got) == [t.name for t in tables]
        for t in tables:
            assert torch.equal(got[t.name], hot[t.name]), t.name


def test_profile_summary_counts_every_lookup_and_the_hot_ones() -> None:
    """The summary a profile prints (hit rates): per table every counted lookup, those
    on its hot rows and how many rows are hot, kept rows of no count included."""
    gen = torch.Generator().manual_seed(4)
    tables = [TableSpec(f"t{i}", rows=r, dim=4, features=(f"f{i}",)) for i, r in enumerate([50, 9, 400])]
    counts = {t.name: torch.randint(0, 4, (t.rows,), generator=gen) * (torch.rand(t.rows, generator=gen) < 0.3)
              for t in tables}
    keep = {"t0": torch.tensor([0, 1, 2]), "t2": torch.tensor([7, 399])}
    opt = make_sparse_optimizer("sgd")
    profile = HotProfile.build(counts, tables, opt, budget_bytes=40 * row_bytes(tables[0], opt), keep=keep)
    for t in tables:
        c = counts[t.name].tolist()
        hot = profile.hot[t.name].tolist()
        assert profile.summary[t.name] == {"lookups": sum(c), "hot_lookups": sum(c[r] for r in hot),
                                           "hot_rows": len(hot)}
