"""A new run that starts from an old run's weights: ``train.init_from=RUN`` (a warm start).

Recommendation models are trained again as days of data arrive. Resuming the old run
on the new days is refused once a table grew (a new id, a new vocabulary value): a
run's tables and vocabularies are fixed at its first fit. A warm start is a NEW run
(its own preprocessing fitted on its own data, its own plan and world size) whose
model, built with its initial values, then takes from the old run's checkpoint:

    dense part     bottom and top MLP, interaction: copied whole (the model.* config and
                   the numbers of dense and sparse features must be the same)
    each table     present in both by name: each row from the old row of the same value
                   (row_map.py); a value the old run never had keeps its initial row; a
                   table only here is initialised, one only there ignored
    sparse state   the optimizer's per-row state (row-wise Adagrad's sum, Adam's moments
                   and step), by the same rows, when optim.sparse is the same
    dense state    the dense optimizer's state (Adagrad's sums, Adam's moments), when
                   optim.dense is the same: fresh sums gave a trained MLP steps of the
                   full learning rate, and the first steps lost what the old run had
                   learnt (tiny.yaml, dense Adagrad: eval AUC 0.7198 to 0.6682 in 10 steps,
                   where resuming the old run gave 0.7126)
    not copied     the progress (step 0), the RNG

Every rank fills its own shards (any plan, world size and placement) from the pieces on
disk, mapped and read by row id (mapped_rows.py): the old model is never loaded whole.
Each piece file read is hashed (by one rank) on other threads while the rows are
gathered, and checked against the old checkpoint's manifest once all are: a mismatch
stops the start on every rank, as a resume's load does. Hashing every file first, then
gathering, read each one twice in turn; from a cold page cache the hash pass alone
took as long as a resume's whole load. Rank 0 holds the checkpoint
(``readers.reading``) so a run still training does not prune it.
A run directory that has a checkpoint resumes it instead: ``init_from`` is for a
fresh run only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data import preprocess as prep_io
from data.preprocess import Preprocessing
from data.schema import Schema
from dlrm.checkpoint.manager import CHECKPOINTS, TABLES, checkpoints, find_checkpoint
from dlrm.checkpoint.manifest import (
    HASH_THREADS,
    CheckpointError,
    check_file,
    check_preprocessing,
    first_verdicts,
    load_meta,
    load_state,
    raise_verdicts,
    schema_from_json,
    verify,
)
from dlrm.checkpoint.mapped_rows import fill_rows
from dlrm.checkpoint.pieces import matrix
from dlrm.checkpoint.readers import reading
from dlrm.checkpoint.row_map import RowMap, row_map, sides
from dlrm.checkpoint.tables import blocks_to_load, raise_first, read_index
from dlrm.models.interface import RecModel
from dlrm.parallel.distributed import DistInfo, all_gather_objects, barrier, broadcast_object
from dlrm.train.optim import load_dense_state
from embeddings.interface import TableState

CHUNK_ROWS = 1 << 16  # new rows mapped and gathered at a time


class InitFromError(CheckpointError):
    """train.init_from names no checkpoint, or one whose model this run cannot take."""


@dataclass
class Copied:
    """What a warm start took from the old run (the header's line, :meth:`line`)."""

    tables: list[str] = field(default_factory=list)  # copied, by value
    rows: int = 0  # rows of the copied tables that came from an old row
    total_rows: int = 0  # rows of every table of this run
    not_copied: dict[str, str] = field(default_factory=dict)  # table → why
    new: list[str] = field(default_factory=list)  # tables only here: initialised
    gone: list[str] = field(default_factory=list)  # tables only there: ignored
    state: str = ""  # what became of the sparse optimizer's state
    dense_state: str = ""  # and of the dense optimizer's

    def line(self, ckpt: Path) -> str:
        count = f"{len(self.tables)} table{'s' * (len(self.tables) != 1)}"
        parts = [(f"from {ckpt}: dense part; {count}, {self.rows:,} of {self.total_rows:,} rows "
                  "carried (the rest initialised)")]
        if self.not_copied:
            parts.append("not copied (initialised): " + ", ".join(
                f"{t} ({why})" for t, why in sorted(self.not_copied.items())))
        if self.new:
            parts.append("new here (initialised): " + ", ".join(sorted(self.new)))
        if self.gone:
            parts.append("not in this run (ignored): " + ", ".join(sorted(self.gone)))
        parts += [self.state, self.dense_state]
        return f"{'init':<9}" + "; ".join(parts)


def source_run(ckpt: Path) -> Path:
    """The run directory a checkpoint belongs to (its preprocessing.json is there)."""
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else ckpt


def _find(source: str) -> Path:
    ckpt = find_checkpoint(Path(source))
    if ckpt is None:
        raise InitFromError(f"train.init_from={source}: no checkpoint there (give a run directory "
                            "with RUN/checkpoints/step-N, or one step-N directory)")
    return ckpt


def check_init_from(config: dict[str, Any], schema: Schema, run_dir: Path, info: DistInfo) -> None:
    """Before a run writes anything: a fresh run's ``train.init_from`` names a checkpoint
    whose model this run can take (else one line, on every rank). A run directory with
    a checkpoint resumes and ignores it. Rank 0 looks; collective."""
    error, source = None, config["train"]["init_from"]
    if info.is_main and not checkpoints(run_dir):
        try:
            with reading(Path(source), find_checkpoint) as found:  # not pruned while read
                ckpt = found if found is not None else _find(source)
                check_model(load_meta(ckpt), config, schema, ckpt)
        except CheckpointError as e:
            error = str(e)
    error = broadcast_object(error, info)
    if error:
        raise InitFromError(error)


def check_model(meta: dict[str, Any], config: dict[str, Any], schema: Schema, ckpt: Path) -> None:
    """Refuse, naming the first difference, an old run whose dense part this run cannot
    take whole, or whose tables are not in pieces (another backend)."""
    where = f"train.init_from: checkpoint {ckpt}"
    backend = config["embeddings"]["backend"]
    if backend != "native":
        raise InitFromError(f"{where}: embeddings.backend={backend} cannot warm-start (a warm start "
                            "fills the native backend's shards); use embeddings.backend=native")
    there = meta["config"]["model"]
    for key, value in config["model"].items():
        if there.get(key) != value:
            raise InitFromError(f"{where}: model.{key} is {there.get(key)!r} there, {value!r} here "
                                "(a warm start takes the dense part whole: the model must be the same)")
    saved = schema_from_json(meta["schema"])
    for what, old, new in (("dense features", len(saved.dense), len(schema.dense)),
                           ("sparse features", len(saved.sparse), len(schema.sparse))):
        if old != new:
            raise InitFromError(f"{where}: {old} {what} there, {new} here (a warm start takes the "
                                "dense part whole: the MLPs' sizes must be the same)")
    if f"{TABLES}/index.json" not in meta["files"]:
        raise InitFromError(f"{where}: its tables are not in table pieces (saved by embeddings.backend="
                            f"{meta['config']['embeddings']['backend']}): a warm start reads those of "
                            "the native backend")


def init_from(source: str, model: RecModel, dense_opt: torch.optim.Optimizer, config: dict[str, Any],
              schema: Schema, preprocess: Preprocessing | None, info: DistInfo) -> str:
    """Copy into ``model`` (built with its initial values) what a warm start takes from
    ``source``'s newest checkpoint (the module docstring); the line saying what it
    took. Collective: every rank fills its own shards."""
    held = reading(Path(source), find_checkpoint) if info.is_main else contextlib.nullcontext()
    with held as found:
        name = broadcast_object(str(found) if found is not None else None, info)
        ckpt = _find(source) if name is None else Path(str(name))
        meta = load_meta(ckpt)
        check_model(meta, config, schema, ckpt)
        check_preprocessing(meta, ckpt)
        verify(ckpt, meta, info, hash_files=False)  # every file there, at its size
        state = load_state(ckpt, meta["files"]["state.pt"], info)
        old_prep = prep_io.load(source_run(ckpt)) if meta.get("preprocessing") else None
        copied = _copy(ckpt, meta, state, model, config, (schema, preprocess),
                       (schema_from_json(meta["schema"]), old_prep), info)
        copied.dense_state = _dense_state(ckpt, meta, state, dense_opt, config)
        barrier(info)  # every rank has read before rank 0 lets the checkpoint go
    return copied.line(ckpt)


def _copy(ckpt: Path, meta: dict[str, Any], state: dict[str, Any], model: RecModel,
          config: dict[str, Any], new: tuple[Schema, Preprocessing | None],
          old: tuple[Schema, Preprocessing | None], info: DistInfo) -> Copied:
    """The dense part, then the tables (through ``model.restore``: a Hotline collection
    then reads its hot rows again)."""
    own, tables = model.state_for_checkpoint()
    if tables is None:
        raise InitFromError("train.init_from: this run's model keeps its tables whole in state.pt: "
                            "a warm start fills the native backend's shards")
    _check_dense(state["dense"], own["dense"], ckpt)
    index = read_index(ckpt / TABLES, meta["files"][f"{TABLES}/index.json"])
    copied = Copied()
    maps = _maps(new, old, index, copied)
    same = meta["config"]["optim"]["sparse"] == config["optim"]["sparse"]
    copied.state = ("sparse optimizer state carried" if same else "sparse optimizer state initialised "
                    f"(optim.sparse={meta['config']['optim']['sparse']} there, {config['optim']['sparse']} here)")
    try:
        model.restore({"dense": state["dense"]},
                      lambda t: _fill_tables(ckpt / TABLES, meta, index, t, maps, same, copied, info))
    except (KeyError, ValueError) as e:
        raise InitFromError(f"train.init_from: checkpoint {ckpt} does not fit the model: {e}") from None
    return copied


def _dense_state(ckpt: Path, meta: dict[str, Any], state: dict[str, Any],
                 dense_opt: torch.optim.Optimizer, config: dict[str, Any]) -> str:
    """Load the old dense optimizer's state when optim.dense is the same (the dense
    parameters are, checked before); what became of it, for the line."""
    there, here = meta["config"]["optim"]["dense"], config["optim"]["dense"]
    if there != here:
        return f"dense optimizer state initialised (optim.dense={there} there, {here} here)"
    try:
        load_dense_state(dense_opt, state["dense_optimizer"])  # the step sets its lr from this config
    except (KeyError, ValueError) as e:
        raise InitFromError(f"train.init_from: checkpoint {ckpt}: its dense optimizer state does "
                            f"not fit: {e}") from None
    return "dense optimizer state carried"


def _check_dense(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], ckpt: Path) -> None:
    """The dense part's tensors have the same names and shapes (one line for the first that
    does not)."""
    for name, tensor in new.items():
        if name not in old:
            raise InitFromError(f"train.init_from: checkpoint {ckpt}: the dense part has no {name}")
        if tuple(old[name].shape) != tuple(tensor.shape):
            raise InitFromError(f"train.init_from: checkpoint {ckpt}: dense {name} is "
                                f"{list(old[name].shape)} there, {list(tensor.shape)} here")


def _maps(new: tuple[Schema, Preprocessing | None], old: tuple[Schema, Preprocessing | None],
          index: dict[str, Any], copied: Copied) -> dict[str, RowMap]:
    """Each table of both runs → its row map (the rows there as the pieces have them);
    the tables that get none are noted in ``copied``."""
    here, there = sides(*new), sides(*old)
    copied.total_rows = sum(side.rows for side in here.values())
    copied.new = [t for t in here if t not in there]
    copied.gone = [t for t in there if t not in here]
    maps = {}
    for table in [t for t in here if t in there]:
        saved = index["keys"].get(f"tables.{table}.weight")
        if saved is None:
            copied.not_copied[table] = "no weight in its pieces"
            continue
        found, why = row_map(here[table], dataclasses.replace(there[table], rows=saved[0][0]))
        if found is None:
            copied.not_copied[table] = why
        else:
            maps[table] = found
            copied.tables.append(table)
    return maps


def _fill_tables(path: Path, meta: dict[str, Any], index: dict[str, Any], tables: TableState,
                 maps: dict[str, RowMap], same_optimizer: bool, copied: Copied, info: DistInfo) -> None:
    """Fill this rank's blocks of every key the warm start takes: each mapped table's
    weight and, with the same sparse optimizer, its state and counters. The piece files
    read are hashed (each by one rank, in the order the keys are filled) on other
    threads meanwhile, and checked once all are read; the rows carried are counted once
    over the ranks into ``copied``. Collective."""
    owner = {f"tables.{spec.name}.{name}": spec.name
             for spec in tables.tables for name in ["weight", *tables.optimizer.state_layout()]}
    wanted: list[tuple[Any, RowMap | None]] = []
    for logical in blocks_to_load(tables):
        saved, table = index["keys"].get(logical.key), owner.get(logical.key)
        if saved is None or tuple(saved[0][1:]) != tuple(logical.size[1:]):
            continue  # not there, or of another width
        if table is None and same_optimizer:  # a counter of the collection (Adam's step)
            wanted.append((logical, None))
        elif table in maps and (logical.key == f"tables.{table}.weight" or same_optimizer):
            wanted.append((logical, maps[table]))
    pieces: dict[str, list[dict[str, Any]]] = {}
    for piece in index["pieces"]:
        pieces.setdefault(piece["key"], []).append(piece)
    files = list(dict.fromkeys(f"{TABLES}/{p['file']}" for lg, _ in wanted for p in pieces.get(lg.key, [])))
    carried, error = 0, None
    with ThreadPoolExecutor(HASH_THREADS) as pool:  # sha256 and reads release the GIL
        verdicts = pool.map(lambda name: check_file(path.parent, name, meta["files"]),
                            files[info.rank::info.world_size])
        try:
            for logical, mapping in wanted:
                filled = _fill_key(path, logical, mapping, pieces.get(logical.key, []),
                                   index["keys"][logical.key][1])
                table = owner.get(logical.key)
                if table is not None and logical.key == f"tables.{table}.weight":
                    carried += sum(n for at, n in filled if _counted_here(tables, table, at, info.rank))
        except (CheckpointError, OSError) as e:
            error = f"checkpoint {path.parent}: {e}" if isinstance(e, OSError) else str(e)
        mine = first_verdicts(list(verdicts))
    everyone = all_gather_objects((mine, error), info)
    raise_verdicts(path.parent, [v for v, _ in everyone])  # first: it would explain a gather error
    raise_first([e for _, e in everyone])
    copied.rows = sum(int(n) for n in all_gather_objects(carried, info))


def _fill_key(path: Path, logical: Any, mapping: RowMap | None, pieces: list[dict[str, Any]],
              dtype: torch.dtype) -> list[tuple[tuple[int, int], int]]:
    """This rank's blocks of one key from the old rows ``mapping`` gives (None: the same
    rows: a counter); a key whole on every holder is filled once and copied to its other
    blocks. Each block filled: its offsets and the rows it took from an old row."""
    out = []
    for block in logical.blocks if logical.split else logical.blocks[:1]:
        dest, at = matrix(block.tensor), (tuple(block.offsets) + (0,))[:2]
        carried = 0
        for start in range(0, dest.shape[0], CHUNK_ROWS):
            first, stop = at[0] + start, at[0] + min(start + CHUNK_ROWS, dest.shape[0])
            old = mapping.old_rows(first, stop) if mapping is not None else np.arange(first, stop)
            with torch.no_grad():
                got = fill_rows(path, pieces, dtype, dest[start:start + stop - first], (first, at[1]), old)
            found = int((old >= 0).sum())
            if got != found * dest.shape[1]:
                raise CheckpointError(f"checkpoint {path.parent}: {logical.key} cannot be read (its "
                                      f"pieces hold {got} of the {found * dest.shape[1]} values wanted)")
            carried += found
        out.append((at, carried))
    with torch.no_grad():
        for block in [] if logical.split else logical.blocks[1:]:
            block.tensor.copy_(logical.blocks[0].tensor)
    return out


def _counted_here(tables: TableState, table: str, at: tuple[int, int], rank: int) -> bool:
    """Whether this rank counts the rows of its block of ``table``'s weight at ``at``: the
    first column's block of those rows, on the lowest rank holding one (a table copied on
    every rank, or split by columns, is counted once)."""
    if at[1] != 0:
        return False
    _, shards = tables.sharding[table]
    holders = [s.rank for s in shards if s.row_start == at[0] and s.col_start == 0]
    return not holders or min(holders) == rank
