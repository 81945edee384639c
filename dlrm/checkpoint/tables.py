"""Sharded checkpoints of embedding collections, streamed and resharded on load.

Every table's weight, and each per-row or per-element optimizer state, is saved
as ONE logical key of the full table's shape. Each rank writes the blocks it holds,
at their offsets, as raw bytes (``pieces.py``: at most 256 MiB of rows per file,
hashed while written, several files at a time); rank 0 writes ``index.json``, which
says which piece of which key lies in which file. Nobody gathers a whole table, and
nothing is copied beyond a 16 MiB buffer per file in flight: the live tensors are
written from, and read into, their own memory.

    saved at W=2 (mixed plan)                 loaded at W=3 (every table row_wise)

    t1 column_wise   cols 0-2  cols 3-5       t1   ┌───────────┐ rank 0: rows  0-8
          weight    ┌────────┬────────┐            ├───────────┤ rank 1: rows  9-16
                    │ rank 0 │ rank 1 │   ──►      ├───────────┤ rank 2: rows 17-24
                    └────────┴────────┘            └───────────┘
          "sum"     [rank 0's copy only]      t1 "sum"  rows 0-8 | 9-16 | 17-24

    t3 row_wise     ┌────────┐ rank 0         t3   read by rows the same way, whatever
                    ├────────┤ rank 1              wrote them: each block asked for is
                    └────────┘                     intersected with the pieces on disk

    embeddings/index.json   {"version": 1, "keys": {key: {"size", "dtype"}},
                             "pieces": [{"key", "file", "offsets", "sizes"}, ...]}
    embeddings/rank-R.N.bin the N-th piece rank R wrote: raw row-major bytes

Keys (all float32 unless the optimizer says otherwise):

    tables.{table}.weight      [rows, dim]
    tables.{table}.{state}     [rows] (row-wise Adagrad "sum") or [rows, dim] (Adam moments)
    optimizer.{state}          a counter of the whole collection (Adam "step", [1] int64)

How each key is laid out from this rank's live tensors (views into the stacked
weights):

    split over ranks (row_wise; column_wise weight and moments)
        this rank's blocks (possibly none); together the ranks' blocks tile the key
    whole on one rank (table_wise, or any table at W=1)
        a block of the whole key on that rank only
    data_parallel, and a column_wise table's row state
        on save the lowest rank holding it writes it (column_wise: the first column
        shard's holder); on load every holder reads it in full (each column shard
        keeps the whole [rows] "sum", kept equal by design)
    optimizer counters
        written once; on load copied into every store's counter

Both functions are collectives on the collection's group: call them on every rank
at the same point. When ``save_embeddings`` returns on any rank the directory is
complete (every file fsynced). Save into a fresh directory and rename it into place
afterwards (rank 0, then a barrier) if a crash must not leave a half-written
checkpoint. The directory must be one shared filesystem path for all ranks. A
``LocalEmbeddingCollection`` is saved and loaded by one process, without a process
group. ``index.json`` is plain JSON: loading runs no code from the checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data.atomic import free_bytes
from data.errors import one_line
from dlrm.checkpoint.manifest import CheckpointCorrupt, CheckpointError, digest, raise_verdicts
from dlrm.checkpoint.pieces import Truncated, matrix, read_overlap, write_piece
from embeddings.interface import TableState
from embeddings.optim import SparseOptimizer
from embeddings.plan.sizes import format_bytes
from embeddings.plan.types import Shard, ShardingType
from embeddings.rounding import weight_dtype
from embeddings.sharding.registry import strategy

INDEX = "index.json"
PIECE_BYTES = 256 << 20  # at most this many bytes of rows per file
THREADS = 4  # files written (and hashed) at a time: they wait on the disk as much as on a core
_PIECE_FILE = re.compile(r"rank-\d+\.\d+\.bin")

# --------------------------------------------------------------------------- API


def save_embeddings(path: str | Path, tables: TableState) -> dict[str, dict[str, Any]]:
    """Write a collection's tables and optimizer state (its ``table_state()``) to
    the directory ``path``; the {"bytes", "sha256"} of each file this rank wrote,
    by name under ``path`` (hashed while written: no second read needed).

    Sharded: a collective on the collection's group, each rank writing its own
    blocks. One process: no process group needed.
    """
    path = Path(path)
    layout = _layout(tables, saving=True)
    rank = _rank(tables)
    holders = _all_gather(tables, [lg.key for lg in layout if not lg.split and lg.blocks])
    writes = [(lg, b) for lg in layout for b in lg.blocks
              if lg.split or min(r for r, keys in enumerate(holders) if lg.key in keys) == rank]
    pieces, tensors, digests, error = [], [], {}, None
    free = free_bytes(path)  # before writing: what the save had to fit in
    try:
        path.mkdir(parents=True, exist_ok=True)
        pieces = _pieces(writes, rank)
        tensors = [p.pop("tensor") for p in pieces]  # the rest goes into the index
        with ThreadPoolExecutor(THREADS) as pool:
            done = pool.map(lambda p, t: write_piece(path / p["file"], t), pieces, tensors)
            digests = {p["file"]: d for p, d in zip(pieces, done)}
    except OSError as e:
        error = unwritable(path, e, sum(t.numel() * t.element_size() for t in tensors), free)
    everyone = _all_gather(tables, (pieces, error))
    raise_first([e for _, e in everyone])
    if rank == 0:
        try:
            digests[INDEX] = _write_index(path, layout, [p for ps, _ in everyone for p in ps])
        except OSError as e:
            error = unwritable(path, e)
    raise_first(_all_gather(tables, error))
    return digests


def load_embeddings(path: str | Path, tables: TableState,
                    expect: dict[str, dict[str, Any]] | None = None) -> None:
    """Read the checkpoint at ``path`` into a collection's ``table_state()``, in
    place, resharding from whatever layout wrote it to the collection's current one
    (the caller then tells the collection: ``tables_loaded()``).

    ``expect``: the manifest's {"bytes", "sha256"} of every file under ``path``, by
    name; each is then hashed as it is read, by one rank (:func:`_hashers`), and
    checked once all are read: one read of every byte, not a second pass to verify.
    A file that does not match raises :class:`CheckpointCorrupt` on every rank after
    the load (the tables then hold a mix: load a whole checkpoint over them).

    Raises :class:`CheckpointError` (one line, naming ``path`` and the key) on every
    rank for a missing or corrupt checkpoint, or one whose tables or shapes differ.
    """
    path = Path(path)
    layout = _layout(tables, saving=False)
    index = _read_index_everywhere(path, tables, layout, expect)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for piece in index["pieces"]:
        by_key.setdefault(piece["key"], []).append(piece)
    # A split key: each block its own part. A whole one: the first copy read, the
    # others copied from it. Blocks are read several at a time (disjoint memory).
    jobs = [(lg.key, b) for lg in layout for b in (lg.blocks if lg.split else lg.blocks[:1])]
    hashes = _hashers(tables, jobs, by_key, expect) if expect is not None else {}
    error = None
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda job: _fill(path, *job, by_key.get(job[0], []), hashes), jobs))
    except CheckpointError as e:
        error = str(e)
    raise_first(_all_gather(tables, error))
    for logical in layout:
        if not logical.split:
            with torch.no_grad():
                for block in logical.blocks[1:]:
                    block.tensor.copy_(logical.blocks[0].tensor)
    if expect is not None:
        _check_hashes(path, tables, expect, hashes)


def _hashers(tables: TableState, jobs: list[tuple[str, _Block]], by_key: dict[str, list[dict[str, Any]]],
             expect: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A sha256 for each piece file this rank hashes while reading it, by name.

    Each file is hashed by exactly one rank: the lowest that reads it whole; else the
    lowest that reads part of it (it then reads the whole file once, in order, and
    copies its part out); a rank reading several parts of one file is neither. A file
    no rank can hash while reading (none, with the layouts written today) is hashed
    on its own by rank ``i % world`` (:func:`_check_hashes`). Collective."""
    mine: dict[str, list[bool]] = {}  # file -> for each read of it by this rank: whole?
    for key, block in jobs:
        dest = matrix(block.tensor)
        at = (block.offsets + (0,))[:2]
        for p in by_key.get(key, []):
            (r0, c0), (nr, nc) = p["offsets"], p["sizes"]
            inside = at[0] <= r0 and r0 + nr <= at[0] + dest.shape[0] and at[1] <= c0 and c0 + nc <= at[1] + dest.shape[1]
            touches = max(r0, at[0]) < min(r0 + nr, at[0] + dest.shape[0]) and \
                max(c0, at[1]) < min(c0 + nc, at[1] + dest.shape[1])
            if touches:
                mine.setdefault(p["file"], []).append(inside)
    reads = {f: ("whole" if w == [True] else "part" if len(w) == 1 else "many") for f, w in mine.items()}
    everyone = _all_gather(tables, reads)
    rank = _rank(tables)
    out = {}
    for name in expect:
        for kind in ("whole", "part"):
            who = [r for r, got in enumerate(everyone) if got.get(name) == kind]
            if who:
                if who[0] == rank:
                    out[name] = hashlib.sha256()
                break
    return out


def _read_index_everywhere(path: Path, tables: TableState, layout: list[_Logical],
                           expect: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """index.json read and checked on every rank, the verdicts gathered before the
    load's first collective: a rank that alone cannot read it (an I/O error on its
    node) raised before, and the others waited in that collective. A CheckpointError
    (unreadable, missing, another model) comes first: where one rank could not read
    it, a resume must not move the checkpoint aside as corrupt; else the first rank's
    changed byte, as CheckpointCorrupt. Collective."""
    verdict: tuple[str, str] | None = None
    index: dict[str, Any] = {}
    try:
        index = _read_index(path, None if expect is None else expect.get(INDEX, {}))
        _check_fits(index, layout, path)
    except CheckpointCorrupt as e:
        verdict = ("corrupt", str(e))
    except CheckpointError as e:
        verdict = ("error", str(e))
    found = [v for v in _all_gather(tables, verdict) if v is not None]
    for kind, error in (("error", CheckpointError), ("corrupt", CheckpointCorrupt)):
        line = next((text for k, text in found if k == kind), None)
        if line is not None:
            raise error(line)
    return index


def _check_hashes(path: Path, tables: TableState, expect: dict[str, dict[str, Any]],
                  hashes: dict[str, Any]) -> None:
    """Compare what this rank hashed while reading with the manifest (files nobody
    read, index.json aside: hashed now, a share each); the first mismatch of
    any rank raised as :class:`CheckpointCorrupt` on every rank. Collective."""
    rank = _rank(tables)
    world = dist.get_world_size(tables.group) if _distributed(tables) else 1
    got = {name: h.hexdigest() for name, h in hashes.items()}
    hashed = _all_gather(tables, sorted(got))
    unread = sorted(set(expect) - {INDEX} - {n for names in hashed for n in names})
    unreadable = None  # an I/O error is a verdict too, gathered: raised alone, the others hung
    for name in unread[rank::world]:
        try:
            got[name] = digest(path / name)["sha256"] if (path / name).is_file() else "missing"
        except OSError as e:
            unreadable = unreadable or f"{path.name}/{name} cannot be read ({e.strerror or e})"
    problem = next((f"{path.name}/{name} does not match its sha256 (corrupt: a changed byte)"
                    for name, sha in sorted(got.items()) if sha != expect[name].get("sha256")), None)
    raise_verdicts(path.parent, [(c, u) for c, u in _all_gather(tables, (problem, unreadable))])


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
    out = []
    for spec in specs:
        sharding, shards = plan_of[spec.name]
        mine = [(s, t) for s, t in held if s.table == spec.name]
        per_key = [("weight", "element", weight_dtype(spec.dtype))]  # each table its own
        per_key += [(n, k, d) for n, (k, d) in kinds.items() if k != "scalar"]
        for name, kind, dtype in per_key:
            size = (spec.rows, spec.dim) if kind == "element" else (spec.rows,)
            out.append(_table_key(f"tables.{spec.name}.{name}", size, dtype, name, kind,
                                  sharding, shards, mine, saving))
    for name, (kind, dtype) in kinds.items():
        if kind == "scalar":  # [1] (StateKind.TABLE_SCALAR); a rank holding no table has no copy
            copies = [_Block(t[name], (0,)) for _, t in held]
            if saving and any(not torch.equal(c.tensor, copies[0].tensor) for c in copies):
                raise RuntimeError(f"optimizer.{name} differs between this rank's stores")
            out.append(_Logical(f"optimizer.{name}", (1,), dtype, False, copies[:1] if saving else copies))
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
        blocks = blocks[:1]  # data_parallel: this rank's copy; the lowest rank holding it writes it
    return _Logical(key, size, dtype, not whole, blocks)






def _state_kinds(optimizer: SparseOptimizer) -> dict[str, tuple[str, torch.dtype]]:
    """Each state name → ("row" [rows] | "element" [rows, cols] | "scalar", dtype), as
    the optimizer declares it (``SparseOptimizer.state_layout``)."""
    return {name: (spec.kind.value, spec.dtype) for name, spec in optimizer.state_layout().items()}


# --------------------------------------------------------------------------- pieces


def _pieces(writes: list[tuple[_Logical, _Block]], rank: int) -> list[dict[str, Any]]:
    """This rank's blocks cut into row ranges of at most PIECE_BYTES, each a file:
    {"key", "file", "offsets", "sizes", "tensor"} (offsets and sizes as [row, col])."""
    out: list[dict[str, Any]] = []
    for logical, block in writes:
        t = matrix(block.tensor)
        at = (block.offsets + (0,))[:2]
        step = max(1, PIECE_BYTES // max(1, t.shape[1] * t.element_size()))
        for start in range(0, t.shape[0], step):
            part = t[start : start + step]
            out.append({"key": logical.key, "file": f"rank-{rank}.{len(out)}.bin",
                        "offsets": [at[0] + start, at[1]], "sizes": list(part.shape), "tensor": part})
    return out


def _write_index(path: Path, layout: list[_Logical], pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """index.json (fsynced); its digest."""
    index = {
        "version": 1,
        "keys": {lg.key: {"size": list(lg.size), "dtype": str(lg.dtype).removeprefix("torch.")}
                 for lg in layout},
        "pieces": sorted(pieces, key=lambda p: (p["key"], p["offsets"])),
    }
    body = json.dumps(index, indent=0).encode()
    with open(path / INDEX, "wb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def _fill(path: Path, key: str, block: _Block, pieces: list[dict[str, Any]], hashes: dict[str, Any]) -> None:
    """Read ``block`` of ``key`` from the pieces that overlap it (hashing the files
    in ``hashes`` whole as they are read); every element must be covered."""
    dest = matrix(block.tensor)
    at = (block.offsets + (0,))[:2]
    filled = 0
    with torch.no_grad():
        for piece in pieces:
            try:
                filled += read_overlap(path / piece["file"], (tuple(piece["offsets"]), tuple(piece["sizes"])),
                                       dest, at, hashes.get(piece["file"]))
            except (OSError, Truncated) as e:
                raise CheckpointError(f"checkpoint {path}: {key} cannot be read ({one_line(e)})") from None
    if filled != dest.numel():
        raise CheckpointError(
            f"checkpoint {path}: {key} cannot be read (its pieces cover {filled} of the "
            f"{dest.numel()} values at {list(at)})"
        )


# --------------------------------------------------------------------------- reading safely


def _read_index(path: Path, want: dict[str, Any] | None = None) -> dict[str, Any]:
    """index.json, checked against its manifest entry ``want`` (if given: every rank
    reads it, so every rank sees a mismatch), its shape checked (a file name outside the directory, a size that
    does not fit its key... is refused before anything is read)."""
    file = path / INDEX
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path}: not found (no {file})")
    try:
        body = file.read_bytes()
        if want is not None and hashlib.sha256(body).hexdigest() != want.get("sha256"):
            raise CheckpointCorrupt(f"checkpoint {path.parent}: {path.name}/{INDEX} does not match its sha256 (corrupt: a changed byte)")
        index = json.loads(body)
        keys = {k: (tuple(int(n) for n in v["size"]), _dtype(v["dtype"])) for k, v in index["keys"].items()}
        for p in index["pieces"]:
            size, _ = keys[p["key"]]
            offsets, sizes = [int(n) for n in p["offsets"]], [int(n) for n in p["sizes"]]
            if not _PIECE_FILE.fullmatch(p["file"]):
                raise ValueError(f"piece file {p['file']!r} is not a file of the checkpoint")
            if len(offsets) != 2 or len(sizes) != 2 or min(offsets + sizes) < 0:
                raise ValueError(f"piece {p['file']} has offsets {offsets}, sizes {sizes}")
            rows, cols = size[0] if size else 1, math.prod(size[1:])
            if offsets[0] + sizes[0] > rows or offsets[1] + sizes[1] > cols:
                raise ValueError(f"piece {p['file']} lies outside {p['key']} {list(size)}")
    except CheckpointCorrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or foreign index fails in many ways
        raise CheckpointError(f"checkpoint {path}: {INDEX} is unreadable ({one_line(e, named=True)})") from None
    return {"keys": keys, "pieces": index["pieces"]}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name!r} is not a dtype")
    return dtype


def _check_fits(index: dict[str, Any], layout: list[_Logical], path: Path) -> None:
    """The checkpoint holds exactly the collection's keys, with their sizes and
    dtypes. The same verdict on every rank: it looks at every key, held or not."""
    saved = index["keys"]
    for logical in layout:
        if logical.key not in saved:
            raise CheckpointError(f"checkpoint {path}: {logical.key} is missing (another model or optimizer?)")
        size, dtype = saved[logical.key]
        if size != logical.size:
            raise CheckpointError(
                f"checkpoint {path}: {logical.key} is {list(size)} there, {list(logical.size)} here"
            )
        if dtype != logical.dtype:
            raise CheckpointError(f"checkpoint {path}: {logical.key} is {dtype} there, {logical.dtype} here")
    extra = sorted(set(saved) - {lg.key for lg in layout})
    if extra:
        raise CheckpointError(f"checkpoint {path}: {extra[0]} is there but not in this collection")


# --------------------------------------------------------------------------- for other readers


def blocks_to_load(tables: TableState) -> list[_Logical]:
    """Every key of a collection as :func:`load_embeddings` fills it: its full size and
    dtype, whether the ranks' blocks tile it (``split``), and this rank's blocks (live
    views at their offsets). A warm start (``warm_start.py``) reads other rows into them."""
    return _layout(tables, saving=False)


def read_index(path: Path, want: dict[str, Any] | None = None) -> dict[str, Any]:
    """``index.json`` of the tables at ``path``, checked (its sha256 against ``want``, its
    pieces against its keys): {"keys": {key: (size, dtype)}, "pieces": [...]}."""
    return _read_index(path, want)


# --------------------------------------------------------------------------- ranks


def _distributed(tables: TableState) -> bool:
    """A sharded collection coordinates over its group; one process, or a run
    without a process group, works alone."""
    return tables.plan is not None and dist.is_initialized()


def _rank(tables: TableState) -> int:
    return dist.get_rank(tables.group) if _distributed(tables) else 0


def _all_gather(tables: TableState, obj: Any) -> list[Any]:
    """Every rank's ``obj`` of the collection's group, in rank order."""
    if not _distributed(tables):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(tables.group)
    dist.all_gather_object(out, obj, group=tables.group)
    return out


def raise_first(errors: list[str | None]) -> None:
    """The same CheckpointError on every rank, if any rank had one."""
    for error in errors:
        if error:
            raise CheckpointError(error)


def unwritable(path: str | Path, error: OSError, needed: int = 0, free: int | None = None) -> str:
    """One line for a checkpoint file that cannot be written; for a full disk or quota
    also what its file system had free (``free``, measured before the save wrote
    anything; else now) and what this rank's pieces needed, where known."""
    line = f"checkpoint {path}: cannot be written ({one_line(error, named=True)})"
    if error.errno in (errno.ENOSPC, errno.EDQUOT, None):
        when = "when the save began" if free is not None else "now"
        free = free_bytes(path) if free is None else free
        if free is not None:
            line += f"; {format_bytes(free)} free on its file system {when}"
        if needed:
            line += f", {format_bytes(needed)} of table pieces to write from this rank"
    return line + "; the checkpoints before it are kept"
