"""Hotline with per-table dtypes (``embeddings.dtypes``): each dtype's tables in a Hotline
collection of their own, both tiers in that type, equal to ordinary training with the
same per-table dtypes.

The trainer's step is exercised as the trainer runs it (``split`` cases): the
mini-batch split jointly on the device (popular only if every lookup of every dtype
group is hot), the header read once, the popular micro-batch hot only, the other with
its gathered cold rows; refresh planned, its entering rows read ahead, then swapped
after a step whose cold update wrote some of them.

References: ``DtypeStacks`` (what ``dlrm train`` runs for one process with several
dtypes: one stack per dtype), on the same batches and seeds; at 2 ranks the single process on the
whole batch (as tests/test_hotline_half.py does for one dtype). Weights are compared bit
for bit: a table's rows get the same fp32 update and the same stochastic rounding bits
(keyed by table, row and column, not by stack or tier).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from embeddings.dtype_stacks import DtypeStacks
from embeddings.hotline.lookups import HOT_ONLY
from embeddings.hotline.mixed import MixedHotlineCollection, hotline_collection
from embeddings.hotline.split import samples_of
from embeddings.interface import Prefetched
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.planner import fixed_plan
from embeddings.sharded import gather_tables
from embeddings.table import Pooling
from tests.multiprocess import run_ranks
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, LR, hot_sets, profile_of, rows_of
from tests.test_mixed_dtypes import DTYPES as SHARDED_DTYPES
from tests.test_sharded_embeddings import PLANS, STEPS, local_slice, make_tables, rank_rows

DTYPES = {"t0": "bf16", "t_shared": "fp32", "t2": "fp16"}  # the fp32 group is not the first
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ordinary(tables, optimizer: str, state: str = "fp32", fused: bool = True, seed: int = 5):
    """One process, several dtypes, as ``dlrm train`` runs it: one stack per dtype."""
    return DtypeStacks(tables, lambda: make_sparse_optimizer(optimizer, state_dtype=state), fused=fused, seed=seed)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    """Half tables (and half state) bit for bit, each in its type. fp32 tables within
    fp32 rounding: a mean bag's hot and cold parts are pooled apart and a shared table's
    gradient summed in another order (1.5e-8 apart on this fixture, fp32 Hotline against
    the plain collection, as tests/test_hotline.py allows)."""
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        assert got[key].dtype == value.dtype, f"{label} {key}"
        if value.dtype in (torch.bfloat16, torch.float16) or key.endswith("rounding_step"):
            assert torch.equal(got[key], value), f"{label} {key}"
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=f"{label} {key}")


CASES = [("rowwise_adagrad", "half", True, "fp32", "direct"), ("sgd", "all", False, "fp32", "prefetch"),
         ("adam", "half", False, "bf16", "split"), ("adagrad", "none", True, "fp16", "direct"),
         ("rowwise_adagrad", "half", False, "fp32", "split"), ("sgd", "none", False, "fp32", "split")]


def trainer_step(hot: MixedHotlineCollection, kjt, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward + backward as dlrm/train/hotline.py runs them: (pooled [B, F*D] put back
    in batch order, the host ids the cold gather returned)."""
    split = hot.split_on_device(kjt, host=kjt)
    sizes = split.read_sizes(split.header)  # the one host read
    assert sizes.group0 == int((split.parts[0].group == 0).sum())
    out = torch.zeros(kjt.stride(), len(FEATURES) * hot.dim)
    touched = None
    for group in (0, 1):
        samples = samples_of(split, sizes, group)
        micro = hot.micro_batch(split, sizes, group)
        cold = HOT_ONLY if group == 0 else hot.gather_cold(micro)
        if group == 1:
            touched = cold.host_ids
        part = hot(Prefetched(micro, cold))
        (part * up.index_select(0, samples)).sum().backward()
        out[samples] = part.detach()
    return out, touched


@pytest.mark.parametrize("kind,share,fused,state,mode", CASES)
def test_mixed_hotline_equals_ordinary_bit_for_bit(kind: str, share: str, fused: bool, state: str,
                                                    mode: str) -> None:
    steps = 4
    pooling = Pooling.MEAN if kind == "rowwise_adagrad" else Pooling.SUM
    tables = [dataclasses.replace(t, dtype=DTYPES[t.name]) for t in tables_fixture(pooling)]
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=6, max_len=1 if s < 2 else 3, seed=s) for s in range(steps)]
    ups = [torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]
    ref = ordinary(tables, kind, state, fused)
    hot = hotline_collection(tables, profile_of(tables, hot_sets(tables, kjts, share, 0)),
                             make_sparse_optimizer(kind, state_dtype=state), fused=fused, seed=5)
    assert isinstance(hot, MixedHotlineCollection) and len(hot.groups) == 3
    for group in hot.groups:  # each tier holds its tables in their own type
        want = TORCH[group.tables[0].dtype]
        assert group.hot_weight.dtype == group.host.weight.dtype == want
    plan = None
    for s, (kjt, up) in enumerate(zip(kjts, ups)):
        if s == steps // 2 - 1 and mode == "split":  # planned and read ahead a step early
            plan = hot.plan_refresh(profile_of(tables, hot_sets(tables, kjts, "half", 1)))
            hot.prefetch_entering(plan)
        elif s == steps // 2 and mode != "split":
            hot.refresh(profile_of(tables, hot_sets(tables, kjts, "half", 1)))
        ref.set_lr(LR)
        hot.set_lr(LR)
        want = ref(kjt)
        (want * up).sum().backward()
        if mode == "split":
            got, touched = trainer_step(hot, kjt, up)
        else:
            got = hot(Prefetched(kjt, hot.gather_cold(kjt))) if mode == "prefetch" else hot(kjt)
            (got * up).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        ref.step()
        hot.step()
        if plan is not None:  # the trainer's refresh: after the step that wrote ``touched``
            assert plan.moved_rows > 0
            hot.refresh(plan, touched)
            plan = None
    label = f"{kind} {share} fused={fused} state={state} {mode}"
    assert_same(hot.export_tables(), ref.export_tables(), label)
    for group in hot.groups:  # every group counts the steps in both tiers, its fp32 one too
        assert int(group.hot_state["rounding_step"]) == int(group.host.state["rounding_step"]) == steps


def test_classify_and_hot_only_microbatch() -> None:
    """classify: a sample is popular when every lookup of it, in every group, is hot
    (reference: torch.isin per feature); a hot-only micro-batch (``HOT_ONLY``: no cold
    part in any group) equals ordinary training."""
    tables = [dataclasses.replace(t, dtype=DTYPES[t.name]) for t in tables_fixture()]
    table_of = {f: t.name for t in tables for f in t.features}
    kjt = random_kjt(FEATURES, rows_of(tables), batch=8, max_len=2, seed=3)
    hot_rows = hot_sets(tables, [kjt], "half", 0)
    hot = hotline_collection(tables, profile_of(tables, hot_rows), make_sparse_optimizer("sgd"), fused=False, seed=5)
    popular, share = hot.classify(kjt)
    cold_in_sample, hits, total = torch.zeros(8, dtype=torch.bool), 0, 0
    for f, jt in kjt.to_dict().items():
        is_hot = torch.isin(jt.values(), hot_rows[table_of[f]])
        sample = torch.repeat_interleave(torch.arange(8), jt.lengths())
        cold_in_sample[sample[~is_hot]] = True
        hits, total = hits + int(is_hot.sum()), total + is_hot.numel()
    assert torch.equal(popular, ~cold_in_sample) and 0 < int(popular.sum()) < 8
    assert share == pytest.approx(hits / total)

    everything = hotline_collection(tables, profile_of(tables, hot_sets(tables, [kjt], "all", 0)),
                                    make_sparse_optimizer("sgd"), fused=False, seed=5)
    ref = ordinary(tables, "sgd", fused=False)
    up = torch.randn(8, 16, generator=torch.Generator().manual_seed(9))
    assert bool(everything.classify(kjt)[0].all())
    for coll, arg in ((ref, kjt), (everything, Prefetched(kjt, HOT_ONLY))):
        coll.set_lr(LR)
        (coll(arg) * up).sum().backward()
        coll.step()
    assert_same(everything.export_tables(), ref.export_tables(), "hot only")


def train_hotline_ranks(rank: int, world_size: int, optim: str) -> dict:
    tables = [dataclasses.replace(t, dtype=SHARDED_DTYPES[t.name]) for t in make_tables()]
    plan = fixed_plan(tables, world_size, PLANS["mixed"](world_size))
    hot_rows = {t.name: torch.arange(0, t.rows, 3) for t in tables}  # a third of every table
    coll = hotline_collection(tables, profile_of(tables, hot_rows), make_sparse_optimizer(optim),
                              fused=False, seed=7, plan=plan)
    assert coll.plan is plan and coll.sharded
    pooled = []
    for step in range(STEPS):
        kjt, upstream = local_slice(step, rank, world_size)
        coll.set_lr(0.1)
        out = coll(Prefetched(kjt, coll.gather_cold(kjt)))
        pooled.append(out.detach().clone())
        (out * upstream).sum().backward()
        coll.step()
    coll.sync_to_host()
    tables_out = {}
    for group in coll.groups:
        tables_out.update({k: v.clone() for k, v in gather_tables(group.host).items()})
    return {"tables": tables_out, "pooled": pooled}


def one_process(optim: str) -> tuple[dict, list]:
    tables = [dataclasses.replace(t, dtype=SHARDED_DTYPES[t.name]) for t in make_tables()]
    coll = ordinary(tables, optim, seed=7)
    pooled = []
    for step in range(STEPS):
        kjt, upstream = local_slice(step, 0, 1)
        coll.set_lr(0.1)
        out = coll(kjt)
        pooled.append(out.detach().clone())
        (out * upstream).sum().backward()
        coll.step()
    return {k: v.clone() for k, v in coll.export_tables().items()}, pooled


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "rowwise_adagrad", "adam"])
def test_two_rank_mixed_hotline_equals_one_process(optim: str) -> None:
    want, want_pooled = one_process(optim)
    for rank, got in enumerate(run_ranks(2, train_hotline_ranks, optim)):
        assert_same(got["tables"], want, f"W=2 rank {rank} {optim}")
        start, end = rank_rows(rank, 2)
        for a, b in zip(got["pooled"], want_pooled, strict=True):
            torch.testing.assert_close(a, b[start:end], rtol=1e-5, atol=1e-6)


HOTLINE = {"embeddings.placement": "hotline", "hotline.budget": "1MB", "hotline.fill_unseen": False}
MIXED = {"embeddings.dtypes.C1": "bf16", "embeddings.dtypes.C2": "fp16", "embeddings.dtypes.C3": "bf16"}


@pytest.mark.slow
def test_mixed_hotline_training_equals_ordinary_and_resumes(tiny_data, tmp_path: Path) -> None:
    """``dlrm train`` with Hotline and per-table dtypes: the run's tables (checkpoint,
    loaded into the plain model) equal ordinary training's; a resumed run equals the
    uninterrupted one bit for bit."""
    from tests.run_state import assert_states_close, run_state
    from tests.test_mixed_dtypes import run_train

    extra = {**MIXED, "optim.sparse": "rowwise_adagrad", "train.max_steps": 12, "data.eval": ""}
    run_train(tiny_data, tmp_path / "plain", **extra)
    summary = run_train(tiny_data, tmp_path / "hot", **extra, **HOTLINE)
    assert 0.0 < summary["hotline"]["popular_share"] < 1.0  # both micro-batches ran
    # loaded into the plain model of several dtypes: the sharded collection on one rank,
    # whose keys name whole-table shards
    hot, plain = ({k.replace("/rows0/cols0", ""): v for k, v in run_state(tmp_path / r).items()}
                  for r in ("hot", "plain"))
    assert hot["tables.C1.weight"].dtype == torch.bfloat16 and hot["tables.C2.weight"].dtype == torch.float16
    assert_states_close(hot, plain, "hotline mixed")
    run_train(tiny_data, tmp_path / "resumed", **{**extra, "train.max_steps": 5}, **HOTLINE)
    run_train(tiny_data, tmp_path / "resumed", **extra, **HOTLINE)
    resumed = {k.replace("/rows0/cols0", ""): v for k, v in run_state(tmp_path / "resumed").items()}
    for key, value in hot.items():
        assert torch.equal(resumed[key], value), key
