"""Checkpoints of a run: kept, crash-safe, verified as they load, never running code.

    RUN/checkpoints/step-000000120/        a complete checkpoint (the newest
        meta.json                          train.keep_checkpoints are kept)
        state.pt                           tensors only (torch.load weights_only=True):
                                           dense model, dense optimizer, RNG (rank 0)
        embeddings/index.json, rank-R.N.bin  the tables (dlrm/checkpoint/tables.py):
                                           every rank streams its own shards; loads
                                           into any world size and plan
    RUN/checkpoints/step-000000150.partial/  a save in progress, or one a kill cut
                                           short: never read, removed by the next save
    RUN/checkpoints/step-000000140.corrupt/  failed verification; moved aside by the
                                           resume that fell back to an older one
    RUN/checkpoints/best.json              train.keep_best: the checkpoint of the best
                                           eval, never pruned (dlrm/train/best.py)

meta.json holds the format version, the progress, the full config, the schema, the
plan that wrote the shards, and a manifest: size and sha256 of every other file
(``index.json`` and the shard files included, each hashed as it was written), plus a
sha256 of meta.json's own content.

A save, all ranks together (a collective)::

    rank 0: mkdir step-N.partial ─► all: embedding shards, hashed and fsynced as they
    are written ─► rank 0: state.pt (the same) ─► all: gather the hashes ─► rank 0:
    meta.json with the manifest, fsync, rename step-N.partial → step-N, drop the
    oldest beyond keep (not one a `dlrm eval` is reading: readers.py) ─► all: barrier

A file that cannot be written (a full disk) is one CheckpointError on every rank,
and the half-written step-N.partial is removed.

A checkpoint directory gets its final name only once every byte of it is on disk,
so a kill at any moment leaves the previous checkpoints as they were: the next
resume uses the newest complete one. Loading checks the manifest as it reads, each
byte once (:func:`load_checkpoint`): a missing, truncated or altered file is refused
(:class:`CheckpointCorrupt`, naming the file and why); a resume then loads the
newest older one that verifies over whatever was half-loaded, saying so. A
checkpoint of another format version or another model is refused
(:class:`CheckpointError`). The plan is recorded, not enforced: the shards reshard
on load into any world size and plan, and their table shapes are checked.
With several nodes the run directory must be on a shared file system.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.atomic import fsync, write_atomic
from data.preprocess import digest as preprocessing_digest
from data.schema import Schema
from dlrm.checkpoint.faults import inject
from dlrm.checkpoint.manifest import (
    FORMAT_VERSION,
    CheckpointCorrupt,
    CheckpointError,
    check_compatible,
    check_preprocessing,
    digest,
    load_meta,
    load_state,
    meta_digest,
    save_digested,
    schema_to_json,
    verify,
)
from dlrm.checkpoint.readers import unread
from dlrm.checkpoint.tables import load_embeddings, raise_first, save_embeddings, unwritable
from dlrm.models.interface import RecModel
from dlrm.parallel.distributed import DistInfo, all_gather_objects, barrier, broadcast_object
from dlrm.train.optim import load_dense_state

TABLES = "embeddings"  # RUN/checkpoints/step-N/embeddings/: the tables
CHECKPOINTS = "checkpoints"  # RUN/checkpoints/step-NNNNNNNNN/
LEGACY = "checkpoint"  # RUN/checkpoint/ of format version 2: found, then refused by version
PARTIAL = ".partial"  # a save in progress (or cut short)
DELETING = ".deleting"  # an old checkpoint being removed
CORRUPT = ".corrupt"  # one that failed verification, moved aside by a resume (kept to inspect)
BEST = "best.json"  # RUN/checkpoints/best.json: the checkpoint of the best eval (train.keep_best)
_NAME = re.compile(r"step-(\d+)")


@dataclass
class Progress:
    """Where training stands: the next batch is batch ``step_in_epoch`` of ``epoch``."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


# --------------------------------------------------------------------------- save


def save_checkpoint(
    run_dir: Path,
    model: RecModel,
    dense_opt: torch.optim.Optimizer,
    progress: Progress,
    config: dict[str, Any],
    schema: Schema,
    info: DistInfo | None = None,
    keep: int = 2,
    train_data: dict[str, Any] | None = None,
) -> Path:
    """Save RUN/checkpoints/step-N and keep the newest ``keep``; see the module
    docstring. Collective when there are several ranks: all call it at the same step.
    ``train_data``: the training files' identity (dlrm/train/same_data.py), in meta.json."""
    info = info or DistInfo()
    root = Path(run_dir) / CHECKPOINTS
    step = progress.global_step
    final = root / f"step-{step:09d}"
    partial = final.with_name(final.name + PARTIAL)
    error = None
    if info.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for suffix in (PARTIAL, DELETING):  # saves or removals a kill cut short
                for stale in root.glob(f"step-*{suffix}"):
                    shutil.rmtree(stale)
            partial.mkdir()
        except OSError as e:
            error = unwritable(partial, e)
    raise_first([broadcast_object(error, info)])  # and every rank waits for the mkdir
    try:
        _write(partial, final, model, dense_opt, progress, config, schema, info, run_dir, train_data)
    except CheckpointError:  # every rank raises it together (the writers' errors are gathered)
        if info.is_main:  # never resumed from: its bytes only fill the disk that ran out
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if info.is_main:
        _keep_newest(run_dir, keep)
    barrier(info)
    return final


def _write(partial: Path, final: Path, model: RecModel, dense_opt: torch.optim.Optimizer,
           progress: Progress, config: dict[str, Any], schema: Schema, info: DistInfo,
           run_dir: Path, train_data: dict[str, Any] | None = None) -> None:
    """Every rank's files into ``partial``, then rank 0 seals it as ``final``; a file
    that cannot be written is one CheckpointError on every rank."""
    step = progress.global_step
    state, tables = model.state_for_checkpoint()
    state.update({"dense_optimizer": dense_opt.state_dict(), "rng": torch.get_rng_state()})
    # Every file is hashed (and fsynced) by whoever writes it, as it is written.
    mine, error = {}, None
    if tables is not None:
        written = save_embeddings(partial / "embeddings", tables)  # raises on every rank
        mine.update({f"embeddings/{name}": d for name, d in written.items()})
    inject("kill_after_shards", step, info.rank)
    if info.is_main:
        try:
            mine["state.pt"] = save_digested(state, partial / "state.pt")
        except OSError as e:
            error = unwritable(partial / "state.pt", e)
    gathered = all_gather_objects((mine, error), info)
    raise_first([e for _, e in gathered])
    manifest = {k: v for part, _ in gathered for k, v in part.items()}
    # Anything else under the directory (nothing, today) is read back and hashed.
    names = broadcast_object(_files_under(partial) if info.is_main else None, info)
    rest = [name for name in names if name not in manifest][info.rank::info.world_size]
    others = {name: digest(partial / name, fsync=True) for name in rest}
    manifest.update({k: v for part in all_gather_objects(others, info) for k, v in part.items()})
    if info.is_main:
        plan = tables.plan if tables is not None else None
        meta = {
            "format_version": FORMAT_VERSION,
            "progress": dataclasses.asdict(progress),
            "config": config,
            "schema": schema_to_json(schema),
            "preprocessing": preprocessing_digest(Path(run_dir)),  # sha256 of RUN/preprocessing.json
            "plan": json.loads(plan.to_json()) if plan is not None else None,
            "world_size": info.world_size,
            "train_data": train_data,
            "files": dict(sorted(manifest.items())),
        }
        try:
            _seal(partial, final, meta, names, step, info)
        except OSError as e:
            error = unwritable(partial / "meta.json", e)
    raise_first([broadcast_object(error, info)])


def _seal(partial: Path, final: Path, meta: dict[str, Any], names: list[str], step: int,
          info: DistInfo) -> None:
    """Write meta.json with its own sha256, fsync everything, rename into place."""
    meta["meta_sha256"] = meta_digest(meta)
    with open(partial / "meta.json", "w") as fh:
        fh.write(json.dumps(meta, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    for d in {partial} | {(partial / n).parent for n in names}:
        fsync(d)
    inject("kill_before_rename", step, info.rank)
    if final.exists():  # put there by hand: replaced
        os.replace(final, final.with_name(final.name + DELETING))
    os.replace(partial, final)
    fsync(final.parent)


def _keep_newest(run_dir: Path, keep: int) -> None:
    root = Path(run_dir) / CHECKPOINTS
    best = best_checkpoint(run_dir)
    for old in checkpoints(run_dir, legacy=False)[keep:]:
        if old.name == best:
            continue
        try:
            _remove(old)  # left while `dlrm eval` or `export` reads it: it or a later save removes it
        except FileNotFoundError:  # that reader removed it first
            continue
    for doomed in root.glob(f"step-*{DELETING}"):  # a removal cut short (a kill), or a reader's under way
        shutil.rmtree(doomed, ignore_errors=True)


def _remove(old: Path) -> None:
    """Remove checkpoint ``old`` unless a reader holds it."""
    with unread(old) as free:
        if free:
            doomed = old.with_name(old.name + DELETING)
            os.replace(old, doomed)  # out of sight first: a kill mid-removal leaves no half checkpoint
            shutil.rmtree(doomed)


def prune_after_read(ckpt: Path | None) -> None:
    """Called by a reader (``dlrm eval``, ``export``) once it let ``ckpt`` go: remove it
    if its run saved past it meanwhile (it is no longer among the newest
    ``train.keep_checkpoints``, the keep of the run's newest save) and no other reader
    holds it. The run's own pruning left it for the reader; without this, a run that
    ended while it was read kept it for ever. Best effort: a read-only mount, or the run
    removing it first, leaves it as it is."""
    if ckpt is None or ckpt.parent.name != CHECKPOINTS:
        return
    found = checkpoints(ckpt.parent.parent, legacy=False)
    try:
        keep = int(load_meta(found[0])["config"]["train"]["keep_checkpoints"])
    except (IndexError, CheckpointError, KeyError, TypeError, ValueError):
        return  # no newer save to go by, or one that does not say
    pruned = {p.name for p in found[keep:]} - {best_checkpoint(ckpt.parent.parent)}
    if keep >= 1 and ckpt.name in pruned:
        try:
            _remove(ckpt)
        except OSError:
            pass


def mark_best(run_dir: Path, record: dict[str, Any], keep: int) -> None:
    """Name ``record["checkpoint"]`` (saved) as the best in RUN/checkpoints/best.json, then
    prune: the checkpoint it named before is no longer kept for it (rank 0)."""
    write_atomic(Path(run_dir) / CHECKPOINTS / BEST, json.dumps(record, indent=1) + "\n")
    _keep_newest(run_dir, keep)


def best_checkpoint(run_dir: Path) -> str | None:
    """The checkpoint name RUN/checkpoints/best.json holds, if any."""
    try:
        return json.loads((Path(run_dir) / CHECKPOINTS / BEST).read_text()).get("checkpoint")
    except (OSError, ValueError, AttributeError):
        return None


def _files_under(directory: Path) -> list[str]:
    return sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- find


def checkpoints(run_dir: Path, legacy: bool = True) -> list[Path]:
    """The complete checkpoints of ``run_dir``, newest first (a partial save is no
    checkpoint). ``legacy``: a format-2 ``RUN/checkpoint`` last, so that resuming
    or evaluating an old run is refused by version rather than ignored."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.fullmatch(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    out = [p for _, p in sorted(found, reverse=True)]
    if legacy and (run_dir / LEGACY / "meta.json").is_file():
        out.append(run_dir / LEGACY)
    return out


def find_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``run_dir`` (or a checkpoint dir itself);
    not yet verified (:func:`load_checkpoint` does that)."""
    run_dir = Path(run_dir)
    if (run_dir / "meta.json").is_file():
        return run_dir
    found = checkpoints(run_dir)
    return found[0] if found else None


def will_resume(run_dir: Path, info: DistInfo | None = None) -> bool:
    """Whether a start in ``run_dir`` resumes: it has a checkpoint. Then
    :func:`resume_checkpoint` either loads one that verifies, which overwrites every
    table, or raises, so the model can be built without initial table values. The
    same answer on every rank (rank 0 looks)."""
    info = info or DistInfo()
    return bool(broadcast_object(bool(checkpoints(run_dir)) if info.is_main else None, info))


def resume_checkpoint(
    run_dir: Path,
    model: RecModel,
    dense_opt: torch.optim.Optimizer | None,
    config: dict[str, Any] | None,
    schema: Schema,
    info: DistInfo | None = None,
    warn: Callable[[str], None] = print,
) -> tuple[Path, Progress] | None:
    """Load the newest checkpoint of ``run_dir`` whose files verify into ``model``
    (and ``dense_opt``); the checkpoint and the progress to continue at, or None if
    there is none. Each file is verified as the load reads it (:func:`load_checkpoint`:
    one read). A corrupt one is reported through ``warn`` and the one before it
    loaded over the half-loaded model: that load overwrites every tensor (each
    table's every element is read, the dense state dicts are loaded whole, the RNG
    set). Once one loads, the corrupt newer ones are moved aside (``step-N.corrupt``:
    no longer found, not counted among those kept, left to inspect). If all are
    corrupt, the newest one's error is raised and nothing moved. Another format
    version or model is raised at once: older checkpoints would not fit either.
    The same answer on every rank (rank 0 lists; verdicts are gathered)."""
    info = info or DistInfo()
    corrupt: list[tuple[Path, CheckpointCorrupt]] = []
    for ckpt in broadcast_object(checkpoints(run_dir) if info.is_main else None, info):
        try:
            progress = load_checkpoint(ckpt, model, dense_opt, config, schema, info)
        except CheckpointCorrupt as e:
            warn(f"warning: {e}; trying an older checkpoint")
            corrupt.append((ckpt, e))
            continue
        if corrupt and info.is_main:
            for bad, _ in corrupt:
                aside = bad.with_name(bad.name + CORRUPT)
                if aside.exists():
                    shutil.rmtree(aside)
                os.replace(bad, aside)
                warn(f"moved {bad} aside to {aside.name}")
        barrier(info)
        return ckpt, progress
    if corrupt:
        raise corrupt[0][1]
    return None


# --------------------------------------------------------------------------- load


def load_checkpoint(
    ckpt: Path,
    model: RecModel,
    dense_opt: torch.optim.Optimizer | None,
    config: dict[str, Any] | None,
    schema: Schema,
    info: DistInfo | None = None,
) -> Progress:
    """Restore ``model`` (and ``dense_opt``) from ``ckpt``; the progress to continue at.

    With ``config`` given, refuses a checkpoint of another model first. Every file
    is checked against the manifest while it is read, so each byte is read once:
    presence and sizes first (a stat: a truncated file is refused before anything
    is loaded); state.pt hashed by rank 0 before it is loaded; the table pieces
    hashed as they are read, each by one rank, and checked once all are read (a
    mismatch raises :class:`CheckpointCorrupt` with the model half-loaded:
    :func:`resume_checkpoint` then loads an older checkpoint over it). Collective
    with several ranks (``info``)."""
    meta = load_meta(ckpt)
    check_preprocessing(meta, ckpt)
    if config is not None:
        check_compatible(meta, config, schema, ckpt)
    files = meta["files"]
    verify(ckpt, meta, info, hash_files=False)
    loaded = {"state.pt"} | {n for n in files if n.startswith(TABLES + "/")}
    verify(ckpt, meta, info, names=[n for n in files if n not in loaded])  # none today: hashed apart
    state = load_state(ckpt, files.get("state.pt", {}), info)
    tables = {n.removeprefix(TABLES + "/"): d for n, d in files.items() if n.startswith(TABLES + "/")}
    try:
        model.restore(state, lambda t: load_embeddings(ckpt / TABLES, t, tables))
        if dense_opt is not None:
            load_dense_state(dense_opt, state["dense_optimizer"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} does not fit the model: {e}") from None
    torch.set_rng_state(state["rng"])
    return Progress(**meta["progress"])
