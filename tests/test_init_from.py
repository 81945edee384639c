"""``train.init_from=RUN``: a new run starts from an old run's weights, rows matched by
value (dlrm/checkpoint/warm_start.py).

References are independent of the code under test: the old run's parameters loaded by
the ordinary checkpoint load into a one-process model (tests/run_state.py), both runs'
vocabularies read from their Parquet files with pyarrow, and a fresh run's initial
values (the same config without init_from)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.preprocess import FILE as PREP_FILE
from data.preprocess import save as save_preprocessing
from data.vocabulary import Vocabulary
from dlrm.checkpoint import manager as ck
from dlrm.checkpoint.manager import Progress, save_checkpoint
from dlrm.checkpoint.manifest import CheckpointCorrupt
from dlrm.checkpoint.row_map import Side, row_map
from dlrm.cli import main
from dlrm.config import load_config, to_dict
from dlrm.parallel.distributed import DistInfo, init_distributed
from dlrm.parallel.parallelize import build_model
from dlrm.parallel.planning import run_tables
from dlrm.train.hotline import make_profile
from dlrm.train.inputs import make_reader, resolve_data
from dlrm.train.trainer import Trainer
from dlrm.train.trainer import train as train_run
from tests.conftest import TINY, tiny_overrides
from tests.multiprocess import run_ranks
from tests.run_state import assert_states_close, run_state

ROWS = 600
WORDS = [f"w{i}" for i in range(12)]
NEW_WORDS = [f"n{i}" for i in range(5)]


def write_day(out: Path, ids: int, words: list[str], seed: int, favourite: str | None = None) -> Path:
    """One day of data: C1 ids 0..ids-1 (identity), C2 words (a vocabulary), C3 bags of
    ids (identity), C4 ids hashed into data.rows={C4: 64}. ``favourite``: a word that
    takes a third of the rows (it moves to row 1 of the vocabulary)."""
    rng = np.random.default_rng(seed)
    c1 = rng.integers(0, ids, ROWS)
    c1[0] = ids - 1  # the table has exactly ``ids`` rows
    c2 = rng.choice(words, ROWS).astype(object)
    if favourite is not None:
        c2[: ROWS // 3] = favourite
    bags = [rng.integers(0, ids, rng.integers(0, 4)).tolist() for _ in range(ROWS)]
    table = pa.table({
        "label": rng.integers(0, 2, ROWS).astype(np.float32),
        "I1": rng.random(ROWS).astype(np.float32),
        "I2": rng.random(ROWS).astype(np.float32),
        "C1": pa.array(c1, pa.int64()),
        "C2": pa.array(list(c2), pa.string()),
        "C3": pa.array(bags, pa.list_(pa.int64())),
        "C4": pa.array(rng.integers(0, 10_000, ROWS), pa.int64()),
    })
    out.mkdir(parents=True)
    pq.write_table(table, out / "part-0.parquet", row_group_size=100)
    return out


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("days")
    return {"old": write_day(root / "old", 40, WORDS, 0),
            # ids up to 59, five new words, one of them the most frequent
            "new": write_day(root / "new", 60, WORDS + NEW_WORDS, 1, favourite="n2")}


def overrides(data: Path, *extra: str) -> list[str]:
    return [*tiny_overrides(), f"data.train={data}", "data.eval=", "data.batch_size=64",
            "data.encodings={C4: hash}", "data.rows={C4: 64}", *extra]


def train(data: Path, run: Path, *extra: str) -> int:
    return main(["train", "--config", str(TINY), "--out", str(run), *overrides(data, "train.max_steps=4",
                                                                                 *extra)])


@pytest.fixture(scope="module")
def old_run(days, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("old") / "run"
    assert train(days["old"], run) == 0
    return run


def started(data: Path, out: Path, *extra: str, info: DistInfo | None = None,
            said: list[str] | None = None) -> Trainer:
    """A run as ``dlrm train`` starts it, up to its first step: the model right after
    init (or the warm start, with train.init_from among ``extra``); its lines into ``said``."""
    cfg = load_config(TINY, overrides(data, *extra))
    info = info or DistInfo()
    say = said.append if said is not None else (lambda line: None)
    out.mkdir(parents=True, exist_ok=True)
    run_data = resolve_data(cfg, out)
    if info.is_main and not (out / PREP_FILE).is_file():  # as dlrm train writes it
        save_preprocessing(run_data.preprocess, out)
    profile = None
    if cfg.embeddings.placement == "hotline":
        reader = make_reader(cfg, run_data.train_files, run_data.schema, True, info.rank, info.world_size,
                             run_data.preprocess)
        profile = make_profile(cfg, run_tables(cfg, run_data.schema), reader, out, say, info)
    model = build_model(cfg, run_data.schema, info.device, info, profile)
    return Trainer(cfg, out, model, run_data, info, say)


def saved_state(trainer: Trainer, info: DistInfo | None = None) -> dict[str, torch.Tensor]:
    """The trainer's parameters as a checkpoint holds them (every rank saves its shards),
    loaded into one process: shards of any plan and placement compared alike."""
    save_checkpoint(trainer.run_dir, trainer.model, trainer.dense_opt, Progress(), to_dict(trainer.cfg),
                    trainer.schema, info)
    return run_state(trainer.run_dir)


def flat(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.model.export_state()
    out = {f"dense.{k}": v.clone() for k, v in state["dense"].items()}
    out.update({f"tables.{k}": v.clone() for k, v in state["tables"].items()})
    return out


def vocabulary(run: Path, table: str) -> list[str]:
    """A run's vocabulary of ``table``, row 1 first, read from its Parquet file."""
    entry = json.loads((run / "preprocessing.json").read_text())["vocabularies"][table]
    return pq.read_table(run / entry["file"])["value"].to_pylist()


# --------------------------------------------------------------------------- the same data


def test_the_same_data_takes_every_parameter(days, old_run: Path, tmp_path: Path) -> None:
    old = run_state(old_run)
    trainer = started(days["old"], tmp_path / "new", f"train.init_from={old_run}")
    new = flat(trainer)
    assert new.keys() == old.keys()
    for key, want in old.items():
        assert torch.equal(new[key], want), key
    # the dense optimizer's state too (tiny.yaml: Adagrad's sums), as state.pt holds it:
    # fresh sums gave the trained MLPs full-lr steps (eval AUC 0.7198 -> 0.7119 in one step)
    saved = torch.load(ck.find_checkpoint(old_run) / "state.pt", weights_only=True)["dense_optimizer"]
    live = trainer.dense_opt.state_dict()
    assert saved["state"] and saved["state"].keys() == live["state"].keys()
    for i, tensors in saved["state"].items():
        for name, want in tensors.items():
            assert torch.equal(live["state"][i][name], want), (i, name)
    fresh = flat(started(days["old"], tmp_path / "fresh"))
    assert not torch.equal(fresh["tables.C1.weight"], old["tables.C1.weight"])  # it did copy


def test_dlrm_train_says_what_it_took_and_a_resume_ignores_it(days, old_run: Path, tmp_path: Path,
                                                             capsys) -> None:
    new = tmp_path / "new"
    assert train(days["old"], new, f"train.init_from={old_run}") == 0
    out = capsys.readouterr().out
    newest = ck.find_checkpoint(old_run)
    rows = 40 + 13 + 40 + 64  # C1, C2 (12 words + OOV), C3, C4
    assert (f"init     from {newest}: dense part; 4 tables, {rows:,} of {rows:,} rows carried "
            "(the rest initialised); sparse optimizer state carried") in out
    assert train(days["old"], new, f"train.init_from={old_run}", "train.max_steps=5") == 0
    out = capsys.readouterr().out
    assert "is used only by a fresh run" in out and "init     from" not in out


# --------------------------------------------------------------------------- grown data


def test_grown_tables_carry_shared_values_and_initialise_new_ones(days, old_run: Path,
                                                                  tmp_path: Path, capsys) -> None:
    old = run_state(old_run)
    trainer = started(days["new"], tmp_path / "new", f"train.init_from={old_run}")
    new = flat(trainer)
    fresh = flat(started(days["new"], tmp_path / "fresh"))
    for name in [k for k in old if k.startswith("dense.")]:
        assert torch.equal(new[name], old[name]), name
    # identity tables: old ids keep their rows, ids 40..59 are new
    for table in ("C1", "C3"):
        for state in ("weight", "sum"):
            key = f"tables.{table}.{state}"
            assert new[key].shape[0] == 60
            assert torch.equal(new[key][:40], old[key]), key
            assert torch.equal(new[key][40:], fresh[key][40:]), key
    # the vocabulary: matched by value through both runs' Parquet files
    before, after = vocabulary(old_run, "C2"), vocabulary(trainer.run_dir, "C2")
    assert after[0] == "n2" and set(after) == set(WORDS + NEW_WORDS)
    assert after != before[: len(after)]  # rows moved: a copy by row would be wrong
    for state in ("weight", "sum"):
        key = f"tables.C2.{state}"
        assert torch.equal(new[key][0], old[key][0])  # the OOV row
        for row, word in enumerate(after, start=1):
            want = old[key][before.index(word) + 1] if word in before else fresh[key][row]
            assert torch.equal(new[key][row], want), (key, word)
    # hashed into as many rows on both sides: row by row
    assert torch.equal(new["tables.C4.weight"], old["tables.C4.weight"])


def test_identity_to_vocabulary_goes_through_the_values(days, old_run: Path, tmp_path: Path) -> None:
    """And the source given as one checkpoint directory, RUN/checkpoints/step-N."""
    old = run_state(old_run)
    trainer = started(days["new"], tmp_path / "new", f"train.init_from={ck.find_checkpoint(old_run)}",
                      "data.encodings={C1: vocabulary, C4: hash}")
    new = flat(trainer)
    fresh = flat(started(days["new"], tmp_path / "fresh", "data.encodings={C1: vocabulary, C4: hash}"))
    ids = vocabulary(trainer.run_dir, "C1")
    assert sorted(ids) == list(range(60))
    assert torch.equal(new["tables.C1.weight"][0], fresh["tables.C1.weight"][0])  # OOV: none there
    for row, value in enumerate(ids, start=1):
        want = old["tables.C1.weight"][value] if value < 40 else fresh["tables.C1.weight"][row]
        assert torch.equal(new["tables.C1.weight"][row], want), value


def test_what_is_not_copied_is_initialised_and_said(days, old_run: Path, tmp_path: Path, capsys) -> None:
    """Another bucket count for the hashed table, another sparse optimizer: the table
    and the optimizer state start fresh, and the line says so."""
    extra = ("data.rows={C4: 32}", "optim.sparse=adam")
    new = tmp_path / "new"
    trainer = started(days["old"], new, f"train.init_from={old_run}", *extra)
    got, fresh, old = flat(trainer), flat(started(days["old"], tmp_path / "fresh", *extra)), run_state(old_run)
    assert torch.equal(got["tables.C4.weight"], fresh["tables.C4.weight"])
    assert torch.equal(got["tables.C1.weight"], old["tables.C1.weight"])
    for key in [k for k in fresh if k.startswith("tables.") and not k.endswith(".weight")]:
        assert torch.equal(got[key], fresh[key]), key  # Adam's moments and step: fresh
    assert train(days["old"], tmp_path / "cli", f"train.init_from={old_run}", *extra) == 0
    out = capsys.readouterr().out
    assert "3 tables, 93 of 125 rows carried" in out
    assert "not copied (initialised): C4 (hashed into 64 rows there, 32 here)" in out
    assert "sparse optimizer state initialised (optim.sparse=rowwise_adagrad there, adam here)" in out


def test_row_maps_by_hand() -> None:
    """Small maps written out: vocabularies of strings and ints, identity, hash."""
    words = Vocabulary(pa.array(["b", "a", "c"], pa.large_string()), np.ones(3, np.int64), 3)
    moved = Vocabulary(pa.array(["c", "d", "b"], pa.large_string()), np.ones(3, np.int64), 3)
    found, _ = row_map(Side("vocabulary", 4, moved), Side("vocabulary", 4, words))
    assert found is not None and found.old_rows(0, 4).tolist() == [0, 3, -1, 1]  # OOV, c, d, b
    assert found.old_rows(2, 4).tolist() == [-1, 1]
    ids = Vocabulary(pa.array([7, 12, 3], pa.int64()), np.ones(3, np.int64), 3)
    found, _ = row_map(Side("vocabulary", 4, ids), Side("identity", 8))
    assert found is not None and found.old_rows(0, 4).tolist() == [-1, 7, -1, 3]
    found, _ = row_map(Side("identity", 14), Side("vocabulary", 4, ids))
    assert found is not None and found.old_rows(2, 14).tolist() == [-1, 3, -1, -1, -1, 1] + [-1] * 4 + [2, -1]
    assert row_map(Side("identity", 8), Side("vocabulary", 4, words)) == (None, "string values there, integer here")
    assert row_map(Side("hash", 8), Side("hash", 16)) == (None, "hashed into 16 rows there, 8 here")
    assert row_map(Side("hash", 8), Side("identity", 8)) == (None, "identity there, hash here")


def test_a_table_only_on_one_side(days, old_run: Path, tmp_path: Path, capsys) -> None:
    """C4 renamed C5: C5 is initialised, C4 ignored, both named; the rest copied."""
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    table = pq.read_table(days["old"] / "part-0.parquet")
    pq.write_table(table.rename_columns([c if c != "C4" else "C5" for c in table.column_names]),
                   renamed / "part-0.parquet", row_group_size=100)
    extra = ("data.encodings={C5: hash}", "data.rows={C5: 64}")
    new = flat(started(renamed, tmp_path / "new", f"train.init_from={old_run}", *extra))
    fresh, old = flat(started(renamed, tmp_path / "fresh", *extra)), run_state(old_run)
    assert torch.equal(new["tables.C5.weight"], fresh["tables.C5.weight"])
    assert torch.equal(new["tables.C2.weight"], old["tables.C2.weight"])
    assert train(renamed, tmp_path / "cli", f"train.init_from={old_run}", *extra) == 0
    out = capsys.readouterr().out
    assert ("3 tables, 93 of 157 rows carried (the rest initialised); new here (initialised): C5; "
            "not in this run (ignored): C4; sparse optimizer state carried") in out


# --------------------------------------------------------------------------- refusals


def test_another_model_is_refused_in_one_line_before_the_run_writes(days, old_run: Path,
                                                                    tmp_path: Path, capsys) -> None:
    out = tmp_path / "new"
    assert train(days["old"], out, f"train.init_from={old_run}", "model.top_mlp=[32,1]") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.top_mlp is [64, 32, 1] there, [32, 1] here" in err[0]
    assert not out.exists()
    assert train(days["old"], out, f"train.init_from={tmp_path / 'nothing'}") == 2
    assert "no checkpoint there" in capsys.readouterr().err
    assert not out.exists()
    assert train(days["old"], out, f"train.init_from={old_run}", "embeddings.backend=torch_baseline") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "embeddings.backend=torch_baseline cannot warm-start" in err[0]
    assert not out.exists()


def test_narrower_tables_take_the_rows_rounded(days, old_run: Path, tmp_path: Path) -> None:
    """bf16 tables from an fp32 run: each row rounded once, to nearest."""
    old = run_state(old_run)
    new = flat(started(days["old"], tmp_path / "new", f"train.init_from={old_run}", "embeddings.dtype=bf16"))
    for table in ("C1", "C2", "C3", "C4"):
        key = f"tables.{table}.weight"
        assert new[key].dtype == torch.bfloat16
        assert torch.equal(new[key], old[key].to(torch.bfloat16)), key
        assert torch.equal(new[f"tables.{table}.sum"], old[f"tables.{table}.sum"])


def test_a_changed_byte_in_a_piece_is_refused(days, old_run: Path, tmp_path: Path, capsys) -> None:
    import shutil

    source = tmp_path / "source"
    shutil.copytree(old_run, source)
    piece = next((ck.find_checkpoint(source) / "embeddings").glob("rank-0.*.bin"))
    body = bytearray(piece.read_bytes())
    body[5] ^= 1
    piece.write_bytes(bytes(body))
    assert train(days["old"], tmp_path / "new", f"train.init_from={source}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"embeddings/{piece.name} does not match its sha256" in err[0]


def test_the_resume_refusal_names_init_from(days, old_run: Path, tmp_path: Path, capsys) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(old_run, run)
    assert train(days["new"], run, "train.max_steps=8") == 2
    err = capsys.readouterr().err
    assert "C1: 40 rows there, C1: 60 here" in err
    assert f"start a new run from this one: --out NEW train.init_from={run}" in err
    # the other way (a run on the grown data resumed with the old, e.g. without its eval
    # files): no warm start to suggest; the data it started with
    big = tmp_path / "big"
    assert train(days["new"], big, "train.max_steps=2") == 0
    capsys.readouterr()
    assert train(days["old"], big, "train.max_steps=4") == 2
    err = capsys.readouterr().err
    assert "C1: 60 rows there, C1: 40 here" in err and "init_from" not in err
    assert "resume with the data.train and data.eval the run started with" in err


# --------------------------------------------------------------------------- placements and ranks


def test_hotline_takes_what_the_plain_placement_takes(days, old_run: Path, tmp_path: Path) -> None:
    """Some rows in the hot tier, the rest on the host: the hot rows are read again after
    the copy (a save writes them back over the host tier: stale hot rows would show)."""
    hot = started(days["new"], tmp_path / "hot", f"train.init_from={old_run}",
                  "embeddings.placement=hotline", "hotline.budget=6KB")
    plain = started(days["new"], tmp_path / "plain", f"train.init_from={old_run}")
    hot_rows = sum(len(ids) for ids in hot.model.embeddings.hot_ids_by_group())
    assert 0 < hot_rows < 202  # both tiers hold rows
    got, want = saved_state(hot), saved_state(plain)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.gpu
def test_tables_on_the_device_take_what_host_tables_take(days, old_run: Path, tmp_path: Path) -> None:
    """The gather lands in CUDA shards (copied there from the mapped pages)."""
    info = DistInfo(device=torch.device("cuda"))
    gpu = flat(started(days["new"], tmp_path / "gpu", f"train.init_from={old_run}", "train.device=cuda",
                       info=info))
    cpu = flat(started(days["new"], tmp_path / "cpu", f"train.init_from={old_run}"))
    assert gpu["tables.C1.weight"].device.type == "cuda"
    for key, want in cpu.items():
        assert torch.equal(gpu[key].cpu(), want), key


PLAN = (("embeddings.plan={C1: {sharding: row_wise}, C2: {sharding: table_wise, ranks: [1]}, "
         "C3: {sharding: column_wise}, C4: {sharding: data_parallel}}"), "embeddings.replicate_max_bytes=0")


def warm_and_save(rank: int, world_size: int, data: Path, source: Path, out: Path, *extra: str) -> str:
    """The warm start on this rank (``extra``: more overrides), saved; the line it said (rank 0)."""
    info = init_distributed("gloo", "cpu")
    said: list[str] = []
    trainer = started(data, out, f"train.init_from={source}", *PLAN, *extra, info=info, said=said)
    save_checkpoint(out, trainer.model, trainer.dense_opt, Progress(), to_dict(trainer.cfg),
                    trainer.schema, info)
    return next((line for line in said if line.startswith("init")), "")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_take_what_one_process_takes(world_size: int, days, old_run: Path, tmp_path: Path) -> None:
    """Row-, table-, column-wise and replicated tables at 2 and 3 ranks end equal to one
    process (and the rows carried are counted once)."""
    lines = run_ranks(world_size, warm_and_save, days["new"], old_run, tmp_path / "ranks")
    said: list[str] = []
    one = started(days["new"], tmp_path / "one", f"train.init_from={old_run}", said=said)
    ref = saved_state(one)
    ranks = run_state(tmp_path / "ranks")
    meta = json.loads((ck.find_checkpoint(tmp_path / "ranks") / "meta.json").read_text())
    assert meta["world_size"] == world_size
    assert {t: p["sharding"] for t, p in meta["plan"]["tables"].items()} == {
        "C1": "row_wise", "C2": "table_wise", "C3": "column_wise", "C4": "data_parallel"}
    assert ranks.keys() == ref.keys()
    for key, want in ref.items():
        assert torch.equal(ranks[key], want), key
    assert lines[0] == next(line for line in said if line.startswith("init"))  # rows counted once


HOTLINE = ("embeddings.placement=hotline", "hotline.budget=6KB")
STEPS = 3


def hotline_ranks(rank: int, world_size: int, data: Path, source: Path, out: Path) -> list[int]:
    """On each rank: the Hotline warm start saved before any step (``out/start``), then
    the same warm start trained ``STEPS`` steps (``out/trained``); this rank's hot rows."""
    warm_and_save(rank, world_size, data, source, out / "start", *HOTLINE)
    hot = started(data, out / "hot", f"train.init_from={source}", *PLAN, *HOTLINE,
                  info=init_distributed("gloo", "cpu"))
    cfg = load_config(TINY, overrides(data, f"train.max_steps={STEPS}", f"train.init_from={source}",
                                      *PLAN, *HOTLINE, "train.log_every=1"))
    train_run(cfg, out / "trained", echo=lambda line: None)
    return [len(ids) for ids in hot.model.embeddings.hot_ids_by_group()]


@pytest.mark.distributed
def test_hotline_ranks_take_what_one_process_takes(days, old_run: Path, tmp_path: Path) -> None:
    """Hotline at 2 ranks (hot rows replicated, cold rows sharded row-, table-, column-wise
    and replicated): right after the warm start every parameter and Adagrad sum equals the
    plain placement's in one process, bit for bit (a hot row left at its initial value, or
    one rank's hot copy not read again, would show: a save writes the hot rows back); and
    after STEPS steps it equals one plain process trained on the same global batches."""
    hot_rows = run_ranks(2, hotline_ranks, days["new"], old_run, tmp_path / "ranks")
    assert all(0 < n < 202 for n in map(sum, hot_rows)), hot_rows  # both tiers hold rows
    start = run_state(tmp_path / "ranks" / "start")
    want = saved_state(started(days["new"], tmp_path / "one", f"train.init_from={old_run}"))
    assert start.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(start[key], value), key
    ref = tmp_path / "ref"
    cfg = load_config(TINY, overrides(days["new"], f"train.max_steps={STEPS}", f"train.init_from={old_run}",
                                      "data.order_world_size=2", "train.log_every=1"))
    train_run(cfg, ref, echo=lambda line: None)
    trained = tmp_path / "ranks" / "trained"
    assert json.loads((trained / "plan.json").read_text())["world_size"] == 2
    got, ref_state = run_state(trained), run_state(ref)
    assert any(not torch.equal(got[k], start[k]) for k in start)  # the steps moved it
    assert_states_close(got, ref_state, "hotline warm start W=2")


def warm_start_refused(rank: int, world_size: int, data: Path, source: Path, out: Path) -> str:
    """The warm start on this rank; the refusal it raised (it must raise)."""
    info = init_distributed("gloo", "cpu")
    with pytest.raises(CheckpointCorrupt) as refused:
        started(data, out, f"train.init_from={source}", *PLAN, info=info)
    return str(refused.value)


@pytest.mark.distributed
def test_a_changed_byte_stops_every_rank(days, old_run: Path, tmp_path: Path) -> None:
    """Each piece file is hashed by one rank alongside the gather: a changed byte in
    one stops both ranks, with the same line naming the file."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(old_run, source)
    pieces = sorted((ck.find_checkpoint(source) / "embeddings").glob("rank-0.*.bin"))
    piece = pieces[-1]
    body = bytearray(piece.read_bytes())
    body[-1] ^= 1
    piece.write_bytes(bytes(body))
    lines = run_ranks(2, warm_start_refused, days["new"], source, tmp_path / "new")
    assert lines[0] == lines[1] and f"embeddings/{piece.name} does not match its sha256" in lines[0]
