"""Sharded checkpoints of embedding collections, resharded on load (torch DCP).

Every table's weight, and each per-row or per-element optimizer state, is saved
as ONE logical tensor of the full table's shape. Each rank hands
``torch.distributed.checkpoint`` the blocks it holds, at their offsets; every
rank writes its own file in parallel and rank 0 writes ``.metadata`` (which
block of which key lies where). Nobody gathers a whole table.

    saved at W=2 (mixed plan)                 loaded at W=3 (every table row_wise)

    t1 column_wise   cols 0-2  cols 3-5       t1   ┌───────────┐ rank 0: rows  0-8
          weight    ┌────────┬────────┐            ├───────────┤ rank 1: rows  9-16
                    │ rank 0 │ rank 1 │   ──►      ├───────────┤ rank 2: rows 17-24
                    └────────┴────────┘            └───────────┘
          "sum"     [rank 0's copy only]      t1 "sum"  rows 0-8 | 9-16 | 17-24

    t3 row_wise     ┌────────┐ rank 0         t3   read by rows the same way, whatever
                    ├────────┤ rank 1              wrote them: DCP intersects the blocks
                    └────────┘                     asked for with the blocks on disk

Keys (all float32 unless the optimizer says otherwise):

    tables.{table}.weight      [rows, dim]
    tables.{table}.{state}     [rows] (row-wise Adagrad "sum") or [rows, dim] (Adam moments)
    optimizer.{state}          a counter of the whole collection (Adam "step", [1] int64)

How each logical tensor is built from this rank's live tensors (views into the
stacked weights, so DCP reads straight into the model):

    split over ranks (row_wise; column_wise weight and moments)
        a ShardedTensor of this rank's blocks (possibly none); building it is a
        collective, so every rank builds every such key, in table order
    whole on one rank (table_wise, or any table at W=1)
        a plain tensor on that rank only
    data_parallel, and a column_wise table's row state
        a plain tensor: on save every holder offers the same values and DCP
        writes it once (column_wise: the first column shard alone offers it);
        on load every holder reads it in full (each column shard keeps the whole
        [rows] "sum", kept equal by design)
    optimizer counters
        a plain tensor; on load copied into every store's counter

The trainer's part: call both functions on every rank of the collection's group
at the same point (they are collectives); when ``save_embeddings`` returns on any
rank the directory is complete (DCP writes ``.metadata`` last, then releases the
ranks). Save into a fresh directory and rename it into place afterwards (rank 0,
then a barrier) if a crash must not leave a half-written checkpoint. The
directory must be one shared filesystem path for all ranks. A
``LocalEmbeddingCollection`` is saved and loaded by one process, without a
process group.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard as BlockOf
from torch.distributed._shard.sharded_tensor import ShardedTensor, init_from_local_shards
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from data.errors import one_line
from dlrm.checkpoint.manifest import CheckpointError
from embeddings.interface import TableState
from embeddings.optim import SparseOptimizer
from embeddings.plan.types import Shard, ShardingType
from embeddings.sharding.registry import strategy

# --------------------------------------------------------------------------- API


def save_embeddings(path: str | Path, tables: TableState) -> None:
    """Write a collection's tables and optimizer state (its ``table_state()``) to
    the directory ``path``.

    Sharded: a collective on the collection's group, each rank writing its own
    blocks. One process: no process group needed.
    """
    layout = _layout(tables, saving=True)
    state = _dcp_state(layout, tables)
    try:
        with _quiet():
            dcp.save(state, storage_writer=FileSystemWriter(path), **_dist_args(tables))
    except CheckpointException as e:
        raise _error_from(e, path, "cannot be written") from None


def load_embeddings(path: str | Path, tables: TableState) -> None:
    """Read the checkpoint at ``path`` into a collection's ``table_state()``, in
    place, resharding from whatever layout wrote it to the collection's current one
    (the caller then tells the collection: ``tables_loaded()``).

    Raises :class:`CheckpointError` (one line, naming ``path`` and the key) for a
    missing or corrupt checkpoint, or one whose tables or shapes differ.
    """
    layout = _layout(tables, saving=False)
    reader = _SafeReader(path)
    _check_fits(_read_metadata(reader, path), layout, path)
    state = _dcp_state(layout, tables)
    try:
        with _quiet():
            dcp.load(state, storage_reader=reader, **_dist_args(tables))
    except CheckpointException as e:
        raise _error_from(e, path, "cannot be read") from None
    for logical in layout:  # further live copies of a plain tensor: from the one DCP filled
        with torch.no_grad():
            for block in logical.blocks[1:]:
                block.tensor.copy_(logical.blocks[0].tensor)


# --------------------------------------------------------------------------- layout


@dataclass
class _Block:
    """A live tensor of this rank (a view into a store) at ``offsets`` of a key."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


@dataclass
class _Logical:
    """One key of the checkpoint: its full size, and this rank's blocks of it.

    ``split``: the blocks of all ranks tile it (a ShardedTensor); otherwise every
    block is the whole tensor (a plain tensor; extra blocks are further copies).
    """

    key: str
    size: tuple[int, ...]
    dtype: torch.dtype
    split: bool
    blocks: list[_Block]


def _layout(tables: TableState, saving: bool) -> list[_Logical]:
    """Every key of a collection's tables, in the same order on every rank."""
    held, plan_of, specs = tables.held, tables.sharding, tables.tables
    kinds = _state_kinds(tables.optimizer)
    weight_dtype = held[0][1]["weight"].dtype
    out = []
    for spec in specs:
        sharding, shards = plan_of[spec.name]
        mine = [(s, t) for s, t in held if s.table == spec.name]
        per_key = [("weight", "element", weight_dtype)]
        per_key += [(n, k, d) for n, (k, d) in kinds.items() if k != "scalar"]
        for name, kind, dtype in per_key:
            size = (spec.rows, spec.dim) if kind == "element" else (spec.rows,)
            out.append(_table_key(f"tables.{spec.name}.{name}", size, dtype, name, kind,
                                  sharding, shards, mine, saving))
    for name, (kind, dtype) in kinds.items():
        if kind == "scalar":
            copies = [_Block(t[name], (0,)) for _, t in held]
            if saving and any(not torch.equal(c.tensor, copies[0].tensor) for c in copies):
                raise RuntimeError(f"optimizer.{name} differs between this rank's stores")
            out.append(_Logical(f"optimizer.{name}", tuple(copies[0].tensor.shape), dtype, False,
                                copies[:1] if saving else copies))
    return out


def _table_key(
    key: str,
    size: tuple[int, ...],
    dtype: torch.dtype,
    name: str,
    kind: str,
    sharding: ShardingType,
    shards: list[Shard],
    mine: list[tuple[Shard, dict[str, torch.Tensor]]],
    saving: bool,
) -> _Logical:
    """One table key: split (a ShardedTensor) or whole (a plain tensor)."""
    if kind == "row" and strategy(sharding).per_row_state_whole():
        # Every column shard holds all rows of the same row state; one writes it.
        holders = [(s, t) for s, t in mine if not saving or s == shards[0]]
        return _Logical(key, size, dtype, False, [_Block(t[name], (0,)) for _, t in holders])
    whole = strategy(sharding).saved_whole(shards)
    blocks = [
        _Block(t[name], (s.row_start, s.col_start) if kind == "element" else (s.row_start,))
        for s, t in mine
    ]
    if whole and saving:
        blocks = blocks[:1]  # data_parallel: this rank's copy; DCP keeps one of the ranks'
    return _Logical(key, size, dtype, not whole, blocks)






def _state_kinds(optimizer: SparseOptimizer) -> dict[str, tuple[str, torch.dtype]]:
    """Each state name → ("row" [rows] | "element" [rows, cols] | "scalar", dtype), as
    the optimizer declares it (``SparseOptimizer.state_layout``)."""
    return {name: (spec.kind.value, spec.dtype) for name, spec in optimizer.state_layout().items()}


# --------------------------------------------------------------------------- DCP


def _dcp_state(layout: list[_Logical], tables: TableState) -> dict[str, torch.Tensor | ShardedTensor]:
    """The state dict DCP sees: a ShardedTensor per split key (built collectively,
    every rank, in layout order), this rank's first copy of every whole key it holds."""
    group = tables.group
    state: dict[str, torch.Tensor | ShardedTensor] = {}
    for logical in layout:
        if logical.split:
            rank = dist.get_rank()  # ShardedTensor placements name global ranks
            blocks = [BlockOf.from_tensor_and_offsets(b.tensor, list(b.offsets), rank)
                      for b in logical.blocks]
            state[logical.key] = init_from_local_shards(blocks, *logical.size, process_group=group)
        elif logical.blocks:
            state[logical.key] = logical.blocks[0].tensor
    return state


def _dist_args(tables: TableState) -> dict[str, Any]:
    """A sharded collection coordinates over its group; one process, or a run
    without a process group, uses DCP's single-process mode."""
    if tables.plan is not None and dist.is_initialized():
        return {"process_group": tables.group}
    return {"no_dist": True}


@contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's "assuming the intent is to save in a single process" warning and
    its ShardedTensor deprecation notice (DTensor cannot hold our uneven or
    rank-subset shards; see the module docstring)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


# --------------------------------------------------------------------------- reading safely


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: DCP's own reader calls
    plain ``pickle.load``, which would run whatever callable the file names."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                     "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _SafeReader(FileSystemReader):
    """DCP's file reader with an allow-listed ``.metadata`` unpickler (tensor data
    it already reads with ``torch.load(weights_only=True)``), reading one item at a
    time so that a failure names the key it was reading."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except Exception as e:  # noqa: BLE001 - truncated or foreign files fail in many ways
                raise CheckpointError(
                    f"checkpoint {self.path}: {item.dest_index.fqn} cannot be read ({one_line(e, named=True)})"
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read_metadata(reader: _SafeReader, path: str | Path) -> Metadata:
    try:
        return reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: not found (no {Path(path) / '.metadata'})") from None
    except Exception as e:  # noqa: BLE001 - a corrupt pickle fails in many ways
        raise CheckpointError(f"checkpoint {path}: .metadata is unreadable ({one_line(e, named=True)})") from None


def _check_fits(metadata: Metadata, layout: list[_Logical], path: str | Path) -> None:
    """The checkpoint holds exactly the collection's keys, with their sizes and
    dtypes. The same verdict on every rank: it looks at every key, held or not."""
    saved = metadata.state_dict_metadata
    wanted = {logical.key: logical for logical in layout}
    for key, logical in wanted.items():
        entry = saved.get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint {path}: {key} is missing (another model or optimizer?)")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path}: {key} is not a tensor there")
        if tuple(entry.size) != logical.size:
            raise CheckpointError(
                f"checkpoint {path}: {key} is {list(entry.size)} there, {list(logical.size)} here"
            )
        if entry.properties.dtype != logical.dtype:
            raise CheckpointError(
                f"checkpoint {path}: {key} is {entry.properties.dtype} there, {logical.dtype} here"
            )
    extra = sorted(set(saved) - set(wanted))
    if extra:
        raise CheckpointError(f"checkpoint {path}: {extra[0]} is there but not in this collection")


def _error_from(e: CheckpointException, path: str | Path, verb: str) -> CheckpointError:
    """DCP gathers every rank's failure; the first one, as one line."""
    failure = next(iter(e.failures.values()))[0]
    if isinstance(failure, CheckpointError):
        return failure
    return CheckpointError(f"checkpoint {path}: {verb} ({one_line(failure, named=True)}){_free_space(path)}")


def _free_space(path: str | Path) -> str:
    """"; N MB free on its file system": a full disk shows up as odd writer errors."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return ""
    return f"; {free / 2**20:,.1f} MB free on its file system"

