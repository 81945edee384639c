"""Sharded embedding checkpoints reshard on load.

Trained at W=2 under a mixed plan and saved; then loaded

    at W=3 under other plans   ─┐
    into one process (no group) ├─► the same whole tables (weights and optimizer
    at W=2 under the same plan ─┘   state), and one more step equals one more
                                    step of the saved run

and a missing, truncated, foreign or malicious checkpoint raises CheckpointError.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dlrm.checkpoint.manager import CheckpointError
from dlrm.checkpoint.manifest import digest
from dlrm.checkpoint.tables import load_embeddings, save_embeddings
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.plan.planner import fixed_plan
from embeddings.plan.types import ShardingType
from embeddings.sharded import ShardedEmbeddingCollection, gather_tables
from embeddings.table import TableSpec
from tests.multiprocess import run_ranks
from tests.test_sharded_embeddings import (
    LR,
    PLANS,
    STEPS,
    assert_tables_equal,
    local_slice,
    make_tables,
    train_reference,
)

OPTIMIZERS = ("adagrad", "rowwise_adagrad", "adam")
TW, CW, RW, DP = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE,
                  ShardingType.DATA_PARALLEL)
# Saved under PLANS["mixed"]: t0 table_wise, t1 column_wise, t2 data_parallel, t3 row_wise.
# Loaded at W=3 with every table's strategy changed, and with everything row_wise.
OTHER_PLANS = {
    "shuffled": lambda W: {"t0": (RW, []), "t1": (TW, [W - 1]), "t2": (CW, []), "t3": (DP, [])},
    "row_wise": PLANS["row_wise"],
}
TRAINED_SEED, FRESH_SEED = 7, 99

Tables = dict[str, torch.Tensor]


def sharded(placements: dict, optim: str, world_size: int, seed: int) -> ShardedEmbeddingCollection:
    tables = make_tables()
    return ShardedEmbeddingCollection(
        tables, fixed_plan(tables, world_size, placements), lambda: make_sparse_optimizer(optim), seed=seed
    )


def train_step(coll: ShardedEmbeddingCollection | LocalEmbeddingCollection, step: int, rank: int,
               world_size: int) -> None:
    kjt, upstream = local_slice(step, rank, world_size)
    coll.set_lr(LR)
    (coll(kjt) * upstream).sum().backward()
    coll.step()


def snapshot(coll: ShardedEmbeddingCollection) -> Tables:
    """Whole tables, copied (gather_tables may hand back live tensors, e.g. Adam's step)."""
    return {k: v.clone() for k, v in gather_tables(coll).items()}


def save_run(rank: int, world_size: int, root: str) -> dict[str, dict[str, Tables]]:
    """Per optimizer: train STEPS steps and save; load into a fresh collection of
    the same plan; then one more step of the original."""
    out = {}
    for optim in OPTIMIZERS:
        coll = sharded(PLANS["mixed"](world_size), optim, world_size, TRAINED_SEED)
        for step in range(STEPS):
            train_step(coll, step, rank, world_size)
        saved = snapshot(coll)
        save_embeddings(Path(root, optim), coll.table_state())
        fresh = sharded(PLANS["mixed"](world_size), optim, world_size, FRESH_SEED)
        load_embeddings(Path(root, optim), fresh.table_state())
        same_plan = snapshot(fresh)
        train_step(coll, STEPS, rank, world_size)
        out[optim] = {"saved": saved, "same_plan": same_plan, "next": snapshot(coll)}
    return out


def load_elsewhere(rank: int, world_size: int, root: str, broken: str) -> dict:
    """Per optimizer and other plan: load, snapshot, one more step, snapshot; and
    the error every rank gets from a broken checkpoint."""
    out: dict = {}
    for optim in OPTIMIZERS:
        for name, placements in OTHER_PLANS.items():
            coll = sharded(placements(world_size), optim, world_size, FRESH_SEED)
            # Verified as read (each file hashed by one rank, some from partial reads).
            expect = {f.name: digest(f) for f in Path(root, optim).iterdir()}
            load_embeddings(Path(root, optim), coll.table_state(), expect)
            loaded = snapshot(coll)
            train_step(coll, STEPS, rank, world_size)
            out[optim, name] = {"loaded": loaded, "next": snapshot(coll)}
    coll = sharded(OTHER_PLANS["shuffled"](world_size), "adam", world_size, FRESH_SEED)
    try:
        load_embeddings(broken, coll.table_state())
        out["broken"] = None
    except CheckpointError as e:
        out["broken"] = str(e)
    return out


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Tables]]]:
    root = tmp_path_factory.mktemp("sharded_ckpt")
    return root, run_ranks(2, save_run, str(root))[0]


def truncated_copy(src: Path, dst: Path) -> Path:
    """``src`` with the largest data file of rank 1 cut to half its length."""
    shutil.copytree(src, dst)
    data = max(dst.glob("rank-1.*.bin"), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return dst


@pytest.mark.distributed
@pytest.mark.slow
def test_same_plan_at_two_ranks(saved_run) -> None:
    _, runs = saved_run
    for optim, run in runs.items():
        states = {"exp_avg", "exp_avg_sq", "step"} if optim == "adam" else {"sum"}
        assert {k.split(".", 1)[1] for k in run["saved"]} == {"weight"} | states
        for key, want in run["saved"].items():
            assert torch.equal(run["same_plan"][key], want), f"W=2 {optim} {key}"


@pytest.mark.distributed
@pytest.mark.slow
def test_other_plans_at_three_ranks_and_resume(saved_run, tmp_path: Path) -> None:
    root, runs = saved_run
    broken = truncated_copy(root / "adam", tmp_path / "broken")
    per_rank = run_ranks(3, load_elsewhere, str(root), str(broken))
    for rank, result in enumerate(per_rank):
        for optim in OPTIMIZERS:
            for name in OTHER_PLANS:
                got = result[optim, name]
                for key, want in runs[optim]["saved"].items():
                    assert torch.equal(got["loaded"][key], want), f"W=3 rank {rank} {optim} {name} {key}"
                assert_tables_equal(got["next"], runs[optim]["next"], f"resume W=3 {optim} {name}")
        assert result["broken"] is not None and str(broken) in result["broken"], result["broken"]
        assert "tables." in result["broken"] or "optimizer." in result["broken"], result["broken"]


# More ranks than the tables need (the planner's choice for 2 big tables on 4 ranks:
# table-wise on ranks 0 and 1): rank 2 holds no shard at all, or only the replicated
# table beside column-wise shards on ranks 0 and 1 (whose row-wise Adagrad sums are
# all-gathered). Both crashed until 2026-12-07: the checkpoint's layout and the row
# sums' device came from the rank's first store.
EMPTY_RANK = {
    "no_shard": {"t0": (TW, [0]), "t1": (TW, [1]), "t2": (TW, [0]), "t3": (TW, [1])},
    "replicas_only": {"t0": (CW, [0, 1]), "t1": (TW, [0]), "t2": (DP, []), "t3": (TW, [1])},
}


def train_save_load(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, placements in EMPTY_RANK.items():
        for optim in ("rowwise_adagrad", "adam"):
            coll = sharded(placements, optim, world_size, TRAINED_SEED)
            for step in range(STEPS):
                train_step(coll, step, rank, world_size)
            saved = snapshot(coll)
            save_embeddings(Path(root, name, optim), coll.table_state())
            fresh = sharded(placements, optim, world_size, FRESH_SEED)
            load_embeddings(Path(root, name, optim), fresh.table_state())
            out[name, optim] = {"saved": saved, "loaded": snapshot(fresh)}
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_holding_no_shard_trains_saves_and_loads(tmp_path: Path) -> None:
    """Rank 2 of 3 holds nothing (or only a replica): training equals one process, and
    the checkpoint saved at W=3 loads back whole (Adam's step included: its one copy
    comes from the ranks that hold tables)."""
    per_rank = run_ranks(3, train_save_load, str(tmp_path))
    references = {optim: {k: v for k, v in train_reference(optim).items() if not k.startswith("pooled@")}
                  for optim in ("rowwise_adagrad", "adam")}
    for rank, result in enumerate(per_rank):
        for (name, optim), got in result.items():
            assert_tables_equal(got["saved"], references[optim], f"{name} {optim} rank {rank}")
            for key, want in got["saved"].items():
                assert torch.equal(got["loaded"][key], want), f"{name} {optim} rank {rank} {key}"


@pytest.mark.distributed
@pytest.mark.slow
def test_one_process_without_group(saved_run) -> None:
    root, runs = saved_run
    for optim, run in runs.items():
        coll = LocalEmbeddingCollection(make_tables(), make_sparse_optimizer(optim), seed=FRESH_SEED)
        assert not torch.equal(coll.export_tables()["t1.weight"], run["saved"]["t1.weight"])
        load_embeddings(root / optim, coll.table_state())
        loaded = {k: v.clone() for k, v in coll.export_tables().items()}
        assert set(loaded) == set(run["saved"])
        for key, want in run["saved"].items():
            assert torch.equal(loaded[key], want), f"local {optim} {key}"
        train_step(coll, STEPS, 0, 1)
        assert_tables_equal(coll.export_tables(), run["next"], f"resume local {optim}")
        # and back: a checkpoint written by one process loads too
        save_embeddings(root / f"{optim}-local", coll.table_state())
        again = LocalEmbeddingCollection(make_tables(), make_sparse_optimizer(optim), seed=FRESH_SEED)
        load_embeddings(root / f"{optim}-local", again.table_state())
        assert_tables_equal(again.export_tables(), coll.export_tables(), f"local round trip {optim}")


class _Payload:
    """Unpickling this runs ``Path.touch`` on a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def local(optim: str = "adam", rows_t0: int = 40) -> LocalEmbeddingCollection:
    tables = [TableSpec("t0", rows=rows_t0, dim=6, features=("a",)), *make_tables()[1:]]
    return LocalEmbeddingCollection(tables, make_sparse_optimizer(optim), seed=FRESH_SEED)


@pytest.mark.distributed
@pytest.mark.slow
def test_bad_checkpoints_raise_checkpoint_error(saved_run, tmp_path: Path) -> None:
    root, _ = saved_run
    with pytest.raises(CheckpointError, match="not found"):
        load_embeddings(tmp_path / "nowhere", local().table_state())

    broken = truncated_copy(root / "adam", tmp_path / "truncated")
    with pytest.raises(CheckpointError, match=r"truncated: (tables|optimizer)\.\S+ cannot be read"):
        load_embeddings(broken, local().table_state())

    with pytest.raises(CheckpointError, match=r"tables\.t0\.weight is \[40, 6\] there, \[41, 6\] here"):
        load_embeddings(root / "adam", local(rows_t0=41).table_state())
    with pytest.raises(CheckpointError, match=r"tables\.t0\.exp_avg is missing"):
        load_embeddings(root / "rowwise_adagrad", local("adam").table_state())
    with pytest.raises(CheckpointError, match=r"tables\.t0\.sum is missing"):
        load_embeddings(root / "adam", local("rowwise_adagrad").table_state())
    # Both Adagrads name their state "sum": a row's scalar there, a sum per element here.
    with pytest.raises(CheckpointError, match=r"tables\.t0\.sum is \[40\] there, \[40, 6\] here"):
        load_embeddings(root / "rowwise_adagrad", local("adagrad").table_state())
    with pytest.raises(CheckpointError, match=r"optimizer\.step is there but not in this collection"):
        load_embeddings(root / "adam", local("sgd").table_state())

    evil = tmp_path / "evil"
    shutil.copytree(root / "adam", evil)
    marker = tmp_path / "code-ran"
    (evil / "index.json").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"index\.json is unreadable"):
        load_embeddings(evil, local().table_state())
    assert not marker.exists()

    index = json.loads((root / "adam" / "index.json").read_text())
    index["pieces"][0]["file"] = "../../outside.bin"
    (evil / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index\.json is unreadable .*not a file of the checkpoint"):
        load_embeddings(evil, local().table_state())


def test_write_error_names_free_space(tmp_path: Path) -> None:
    from dlrm.checkpoint.tables import unwritable

    # reports the nearest existing dir's free space, and the bytes this rank had to write
    line = unwritable(tmp_path / "not" / "yet" / "there", OSError(28, "No space left on device"), 3 << 20)
    free = line.split("; ")[1]
    assert free.endswith(" free on its file system now, 3.0 MiB of table pieces to write from this rank")
    assert float(free.split()[0].replace(",", "")) > 0


def test_write_error_and_missing_piece_are_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # not a disk that ran out: no free-space figures, the cause and that nothing was lost
    with pytest.raises(CheckpointError, match=r"a-file/ckpt: cannot be written \(NotADirectoryError: .*\); "
                       r"the checkpoints before it are kept$"):
        save_embeddings(blocker / "ckpt", local().table_state())

    saved = local()
    digests = save_embeddings(tmp_path / "ckpt", saved.table_state())
    on_disk = {f.name for f in (tmp_path / "ckpt").iterdir()}
    assert set(digests) == on_disk and "index.json" in on_disk  # every file hashed as written
    for name, streamed in digests.items():  # ... and the hashes are the files' own
        assert streamed == digest(tmp_path / "ckpt" / name), name
    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    gone = next(p for p in index["pieces"] if p["key"] == "tables.t1.weight")
    index["pieces"].remove(gone)
    (tmp_path / "ckpt" / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tables\.t1\.weight cannot be read \(its pieces cover 0 of"):
        load_embeddings(tmp_path / "ckpt", local().table_state())
