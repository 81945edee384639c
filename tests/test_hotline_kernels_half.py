"""The Hotline hot tier on the Triton kernels with fp16/bf16 tables or state (Triton's
interpreter on CPU) equals the torch hot tier and ordinary training bit for bit.

The fused update rounds a hot row at its FULL-table coordinates: the table key of the
lookup's feature and ``row_map[slot]`` (the slot's stacked id minus its table's first
row, rebuilt at every load: a refresh, a resume), with the rounding step counted on
the device. References, on the same batches and seeds: the hot tier on the torch path
(``kernels=torch``: the hot rows and their state compared directly) and ordinary
training (``DtypeStacks``, what ``dlrm train`` runs: one stack per dtype). Each run
refreshes its hot set mid-run (slots move: a stale row map would round at the wrong
rows) and the Triton run is then resumed from its exported tables into a fresh
collection of another seed (the rounding step comes back from the checkpoint).
Half tensors and counters are compared bit for bit; fp32 ones within fp32 rounding
(the torch path's update may fuse a multiply-add). Compiled on a GPU, where the
kernel may contract a multiply-add too (a rounding moved with probability ~2^-13),
half tensors are checked as the native path's GPU run checks them: nearly all bits.

The trainer's step is audited (``SyncAudit``): on the Triton path no op waits for the
device, so neither the torch path's host read of the rounding step (``int(...)``:
``aten._local_scalar_dense``) nor its KV-gradient ``unique_consecutive`` is left
(fused: the hot tiers' updates in the backward). And ``dlrm train`` (slow): bf16
tables and Adam state on that path against ordinary training, and resumed bit-exact.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernel_cases import DEVICE  # sets TRITON_INTERPRET=1 without a GPU

pytest.importorskip("triton")

from dlrm.train.sync_audit import SyncAudit
from embeddings.hotline.lookups import HOT_ONLY
from embeddings.hotline.mixed import hotline_collection
from embeddings.hotline.split import samples_of
from embeddings.interface import Prefetched
from embeddings.optim import make_sparse_optimizer
from embeddings.table import Pooling
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, LR, profile_of, rows_of, touched
from tests.test_hotline_kernels import assert_held_kv_gradients_equal
from tests.test_hotline_mixed import DTYPES, ordinary

pytestmark = pytest.mark.kernels
HALF = (torch.float16, torch.bfloat16)
STEPS = 4
REFRESH, RESUME = 2, 3  # before these steps


def hot_profile(tables, kjts, phase: int):
    """Four fifths of the touched rows of every table (which fifth is left out: ``phase``)."""
    return profile_of(tables, {n: ids[ids % 5 != phase] for n, ids in touched(tables, kjts).items()})


def make(kernels: str, tables, kind: str, state: str, fused: bool, profile, seed: int = 4):
    """``seed``: the initial rows'; the rounding seed is the run's (4), resumed or not."""
    return hotline_collection(tables, profile, make_sparse_optimizer(kind, state_dtype=state), fused=fused,
                              seed=seed, device=DEVICE, kernels=kernels, rounding_seed=4)


def trainer_step(coll, kjt, up: torch.Tensor) -> list[SyncAudit]:
    """Kept: one mini-batch as dlrm/train/hotline.py runs it (split on the device, the
    header read, popular then non-popular micro-batch, the step), audited after the read."""
    coll.set_lr(LR)
    split = coll.split_on_device(kjt.to(device=DEVICE), host=kjt)
    sizes = split.read_sizes(split.header)
    assert 0 < sizes.group0 < kjt.stride(), "the fixture needs both micro-batches"
    parts = [(coll.micro_batch(split, sizes, g), samples_of(split, sizes, g)) for g in (0, 1)]
    colds = [HOT_ONLY, coll.gather_cold(parts[1][0])]
    up = up.to(DEVICE)
    with SyncAudit() as audit:
        for (micro, samples), cold in zip(parts, colds):
            (coll(Prefetched(micro, cold)) * up.index_select(0, samples)).sum().backward()
        coll.step()
    return [audit]


def fused_step(coll, kjt, up: torch.Tensor) -> list[SyncAudit]:
    """Fused: the whole mini-batch at once (fused micro-batches would update the hot rows
    twice a step, not ordinary training); the audits of the hot tiers' updates alone
    (the host tier's cold update runs in the same backward, with its own host reads)."""
    coll.set_lr(LR)
    audits: list[SyncAudit] = []
    tiers = hot_tiers(coll)
    for hot in tiers:
        name = "_update" if hot.on_triton() else "apply"
        update = getattr(hot, name)

        def audited(*args, update=update):
            with SyncAudit() as audit:
                update(*args)
            audits.append(audit)

        setattr(hot, name, audited)
    try:
        (coll(kjt.to(device=DEVICE)) * up.to(DEVICE)).sum().backward()
    finally:
        for hot in tiers:
            hot.__dict__.pop("_update", None)
            hot.__dict__.pop("apply", None)
    assert len(audits) == len(tiers)
    return audits


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
                exact: bool = True) -> None:
    """``exact=False``: half tensors as a GPU run's are checked (nearly all bits) on the
    CPU too, where an fp32 sum's order may move a rounding (row-wise Adagrad's mean of
    g^2 over a 64-wide row: torch's and the kernel's differ in the last bit)."""
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        other = got[key].to(value.device)
        assert other.dtype == value.dtype, f"{label} {key}"
        if not value.is_floating_point() or (value.dtype in HALF and DEVICE.type == "cpu" and exact):
            assert torch.equal(other, value), f"{label} {key}"
        elif value.dtype in HALF:  # compiled, a contracted multiply-add may move a rounding
            assert (other == value).float().mean() > 0.99, f"{label} {key}"
            torch.testing.assert_close(other.float(), value.float(), rtol=2.0**-7, atol=1e-4)
        else:
            torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-7, msg=f"{label} {key}")


def hot_tiers(coll) -> list:
    return [g.hot for g in getattr(coll, "groups", [coll])]


def run(tables, kind: str, state: str, fused: bool) -> tuple[dict, object, object]:
    """Ordinary training, the torch hot tier and the Triton hot tier (refreshed, then
    resumed) on the same batches: (ordinary's tables, the torch hot tier's, both hot
    collections at the end)."""
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=8, max_len=2, seed=s) for s in range(STEPS)]
    width = sum(t.dim * len(t.features) for t in tables)  # the pooled output's [B, F*D]
    ups = [torch.randn(8, width, generator=torch.Generator().manual_seed(30 + s))
           for s in range(STEPS)]
    ref = ordinary(tables, kind, state, fused, seed=4)
    paths = {k: make(k, tables, kind, state, fused, hot_profile(tables, kjts, 0)) for k in ("torch", "triton")}
    assert paths["triton"].on_triton() and not paths["torch"].on_triton()
    for s, (kjt, up) in enumerate(zip(kjts, ups)):
        if s == REFRESH:
            for coll in paths.values():
                coll.refresh(hot_profile(tables, kjts, 1))
        if s == RESUME:  # a checkpoint's tables into a fresh collection (another seed)
            saved = {k: v.clone() for k, v in paths["triton"].export_tables().items()}
            paths["triton"] = make("triton", tables, kind, state, fused, hot_profile(tables, kjts, 1), seed=9)
            paths["triton"].import_tables(saved)
        ref.set_lr(LR)
        (ref(kjt) * up).sum().backward()
        ref.step()
        step = fused_step if fused else trainer_step
        audits = step(paths["triton"], kjt, up)
        assert [a.violations for a in audits] == [[]] * len(audits), s
        # what the Triton path removed: the rounding step's host read, the KV coalesce
        torch_syncs = {v for audit in step(paths["torch"], kjt, up) for v in audit.violations}
        assert "aten._local_scalar_dense" in torch_syncs
        assert fused or "aten.unique_consecutive" in torch_syncs
        if DEVICE.type == "cpu":  # launches are counted where interpreted
            assert sum(a.ops["triton._runs_kernel"] for a in audits) == len(hot_tiers(paths["triton"]))
    return ref.export_tables(), paths["torch"], paths["triton"]


# (table dtype, optimizer, state dtype, fused, pooling): every optimizer, fp16 and bf16
# tables and state, half state beside fp32 tables, fused and kept
CASES = [("bf16", "sgd", "fp32", False, Pooling.SUM), ("fp16", "sgd", "fp32", True, Pooling.SUM),
         ("fp16", "rowwise_adagrad", "fp32", True, Pooling.MEAN), ("bf16", "adagrad", "fp16", False, Pooling.SUM),
         ("bf16", "adam", "bf16", True, Pooling.MEAN), ("fp32", "adam", "fp16", False, Pooling.SUM)]


@pytest.mark.parametrize("dtype,kind,state,fused,pooling", CASES)
def test_triton_half_hot_tier_equals_torch_and_ordinary(dtype: str, kind: str, state: str, fused: bool,
                                                         pooling: Pooling) -> None:
    check_half_hot_tier(dtype, kind, state, fused, pooling)


@pytest.mark.parametrize("dtype,kind,state,fused,pooling", [CASES[2], CASES[4]])
def test_triton_half_hot_tier_of_wide_rows_equals_torch_and_ordinary(dtype: str, kind: str, state: str,
                                                                     fused: bool, pooling: Pooling) -> None:
    """D = 64 (bench_gpu's): the half hot tier's row map, rounding and mean at a 64-wide
    tile, which tests/test_kernels_compile.py then compiles (the tables' 8 are 16-wide)."""
    check_half_hot_tier(dtype, kind, state, fused, pooling, dim=64)


def check_half_hot_tier(dtype: str, kind: str, state: str, fused: bool, pooling: Pooling,
                        dim: int | None = None) -> None:
    tables = [dataclasses.replace(t, dtype=dtype, dim=dim or t.dim) for t in tables_fixture(pooling)]
    want, torch_path, triton_path = run(tables, kind, state, fused)
    label = f"{dtype} {kind} state={state} fused={fused} dim={dim or tables[0].dim}"
    exact = dim is None  # 64 wide: 1 of 2,816 fp16 elements moved a rounding (row-wise Adagrad's sum)
    assert triton_path.hot_weight.dtype == torch_path.hot_weight.dtype
    assert torch.equal(triton_path.hot_ids.cpu(), torch_path.hot_ids.cpu())
    assert_same({"weight": triton_path.hot_weight.detach(), **triton_path.hot_state},
                {"weight": torch_path.hot_weight.detach(), **torch_path.hot_state},
                f"hot tier {label}", exact)
    assert int(triton_path.hot_state["rounding_step"]) == int(triton_path.host.state["rounding_step"]) == STEPS
    assert_same(triton_path.export_tables(), torch_path.export_tables(), f"torch hot tier {label}",
                exact)
    assert_same(triton_path.export_tables(), want, f"ordinary {label}", exact)


@pytest.mark.parametrize("kind,state,fused", [("rowwise_adagrad", "fp32", False), ("adam", "bf16", True)])
def test_mixed_dtype_groups_take_triton_and_equal_ordinary(kind: str, state: str, fused: bool) -> None:
    """Per-table dtypes (mixed.py): every group (its fp32 one too, which counts the
    rounding step) on the Triton kernels, equal to the torch groups and ordinary training."""
    tables = [dataclasses.replace(t, dtype=DTYPES[t.name]) for t in tables_fixture(Pooling.SUM)]
    want, torch_path, triton_path = run(tables, kind, state, fused)
    assert len(triton_path.groups) == 3 and all(g.on_triton() for g in triton_path.groups)
    for got, ref in zip(triton_path.groups, torch_path.groups, strict=True):
        assert_same({"weight": got.hot_weight.detach(), **got.hot_state},
                    {"weight": ref.hot_weight.detach(), **ref.hot_state}, f"group {got.tables[0].dtype}")
        assert int(got.hot_state["rounding_step"]) == int(got.host.state["rounding_step"]) == STEPS
    assert_same(triton_path.export_tables(), torch_path.export_tables(), "torch groups")
    assert_same(triton_path.export_tables(), want, "ordinary")


def test_held_half_gradients_by_stacked_id_are_the_torch_paths() -> None:
    """Kept, bf16 tables: the held micro-batches' KV gradient (``kv_gradients``, by
    stacked id) equals the torch path's, after a refresh moved the slots."""
    tables = [dataclasses.replace(t, dtype="bf16") for t in tables_fixture()]
    kjts = [random_kjt(FEATURES, rows_of(tables), batch=8, max_len=3, seed=5)]
    paths = [make(k, tables, "sgd", "fp32", False, hot_profile(tables, kjts, 0)) for k in ("torch", "triton")]
    for coll in paths:
        coll.refresh(hot_profile(tables, kjts, 2))
    assert_held_kv_gradients_equal(paths, kjts[0], 8)


@pytest.mark.slow
def test_half_hotline_on_the_triton_kernels_trains_like_ordinary_and_resumes(tiny_data, tmp_path,
                                                                            monkeypatch) -> None:
    """``dlrm train`` with bf16 tables and bf16 Adam state, the hot tier on the Triton
    kernels, against ordinary training (within fp32 rounding, norm-wise: a bag's hot
    and cold parts are pooled apart, so the dense side's gradients may differ in their
    last bits); stopped after 2 steps and resumed from its checkpoint, it equals the
    uninterrupted run bit for bit (the rounding step and Adam's step come back)."""
    from dlrm.train import trainer as trainer_module
    from tests.conftest import FEW_TABLES
    from tests.run_state import RTOL, assert_states_close, run_state
    from tests.test_hotline_train import HOTLINE, run

    resumed_runs: list[bool] = []
    resume = trainer_module.Trainer._resume
    monkeypatch.setattr(trainer_module.Trainer, "_resume",
                        lambda self: resumed_runs.append(resume(self)) or resumed_runs[-1])

    # batch 32: interpreted, the update of a touched bf16 row with its Adam state takes
    # ~7 ms, most of the test's time (64 took 95 s of CI, 32 55 s)
    common = ("optim.sparse=adam", "embeddings.dtype=bf16", "embeddings.state_dtype=bf16",
              "data.batch_size=32", "train.max_steps=3", FEW_TABLES)
    triton = ("embeddings.kernels=triton", *HOTLINE, "hotline.budget=150KB")  # of 8 x 32 KB bf16
    run(tiny_data, tmp_path / "plain", *common)
    summary = run(tiny_data, tmp_path / "hot", *common, *triton)
    assert summary["hotline"]["hot_tier_triton"] == 1.0
    assert 0.0 < summary["hotline"]["popular_share"] < 1.0  # both micro-batches ran
    hot = run_state(tmp_path / "hot")
    assert hot["tables.C1.weight"].dtype == torch.bfloat16
    assert_states_close(hot, run_state(tmp_path / "plain"), "bf16 hotline triton", RTOL.get("adam", 1e-5))
    run(tiny_data, tmp_path / "resumed", *common, "train.max_steps=2", *triton)
    run(tiny_data, tmp_path / "resumed", *common, *triton)
    assert resumed_runs == [False, False, False, True]  # the last one went on from step 2
    resumed = run_state(tmp_path / "resumed")
    assert resumed.keys() == hot.keys()
    for key, value in hot.items():
        assert torch.equal(resumed[key], value), key
