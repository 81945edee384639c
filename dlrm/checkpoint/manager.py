"""Checkpoints of a run: kept, crash-safe, verified before loading, never running code.

    RUN/checkpoints/step-000000120/        a complete checkpoint (the newest
        meta.json                          train.keep_checkpoints are kept)
        state.pt                           tensors only (torch.load weights_only=True):
                                           dense model, dense optimizer, RNG (rank 0)
        embeddings/.metadata, __R_0.distcp torch.distributed.checkpoint: every rank
                                           writes its own shards; loads into any world
                                           size and plan
    RUN/checkpoints/step-000000150.partial/  a save in progress, or one a kill cut
                                           short: never read, removed by the next save
    RUN/checkpoints/step-000000140.corrupt/  failed verification; moved aside by the
                                           resume that fell back to an older one

meta.json holds the format version, the progress, the full config, the schema, the
plan that wrote the shards, and a manifest: size and sha256 of every other file
(``.metadata`` and shard files included), plus a sha256 of meta.json's own content.

A save, all ranks together (a collective)::

    rank 0: mkdir step-N.partial ─► all: embedding shards (DCP) ─► rank 0: state.pt
    ─► all: hash + fsync a share of the files ─► rank 0: meta.json with the manifest,
    fsync, rename step-N.partial → step-N, drop the oldest beyond keep ─► all: barrier

A checkpoint directory gets its final name only once every byte of it is on disk,
so a kill at any moment leaves the previous checkpoints as they were: the next
resume uses the newest complete one. Loading checks the manifest first: a missing,
truncated or altered file is refused (:class:`CheckpointCorrupt`, naming the file
and why); a resume then falls back to the newest one that verifies, saying so. A
checkpoint of another format version or another model is refused
(:class:`CheckpointError`). The plan is recorded, not enforced: the shards reshard
on load into any world size and plan, and their table shapes are checked.
With several nodes the run directory must be on a shared file system.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.errors import UserError
from data.schema import Schema, SparseFeature

FORMAT_VERSION = 3
CHECKPOINTS = "checkpoints"  # RUN/checkpoints/step-NNNNNNNNN/
LEGACY = "checkpoint"  # RUN/checkpoint/ of format version 2: found, then refused by version
PARTIAL = ".partial"  # a save in progress (or cut short)
DELETING = ".deleting"  # an old checkpoint being removed
CORRUPT = ".corrupt"  # one that failed verification, moved aside by a resume (kept to inspect)
_NAME = re.compile(r"step-(\d+)")


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt or made for another model."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files are missing, truncated or altered since it was saved."""


@dataclass
class Progress:
    """Where training stands: the next batch is batch ``step_in_epoch`` of ``epoch``."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


def schema_to_json(schema: Schema) -> dict[str, Any]:
    return dataclasses.asdict(schema)


def schema_from_json(d: dict[str, Any]) -> Schema:
    return Schema(
        label=d["label"],
        dense=tuple(d["dense"]),
        sparse=tuple(SparseFeature(**f) for f in d["sparse"]),
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write a small text file by temp name + rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- when


class CheckpointSchedule:
    """When to save: every ``train.checkpoint_every`` steps and/or once
    ``train.checkpoint_seconds`` passed since the last save.

    Time is read on rank 0 and its verdict broadcast, so every rank saves at the
    same step (a save is a collective); with ``checkpoint_seconds`` 0 nothing is
    exchanged."""

    def __init__(self, every_steps: int, every_seconds: float, keep: int, info: Any,
                 saved_step: int | None = None) -> None:
        from dlrm.config import ConfigError

        if every_steps < 0 or every_seconds < 0:
            raise ConfigError("train.checkpoint_every and train.checkpoint_seconds must be >= 0")
        if keep < 1:
            raise ConfigError(f"train.keep_checkpoints is {keep}: keep at least 1")
        self.every_steps, self.every_seconds, self.keep, self.info = every_steps, every_seconds, keep, info
        self.saved_step = saved_step
        self.saved_at = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` (a collective when checkpoint_seconds > 0)."""
        due = bool(self.every_steps) and step % self.every_steps == 0
        if self.every_seconds > 0:
            from dlrm.parallel.distributed import broadcast_flag

            late = time.monotonic() - self.saved_at >= self.every_seconds
            due = broadcast_flag(late, self.info) or due
        return due

    def saved(self, step: int) -> None:
        self.saved_step, self.saved_at = step, time.monotonic()


# --------------------------------------------------------------------------- save


def save_checkpoint(
    run_dir: Path,
    model: torch.nn.Module,
    dense_opt: torch.optim.Optimizer,
    progress: Progress,
    config: dict[str, Any],
    schema: Schema,
    info: Any = None,
    keep: int = 2,
) -> Path:
    """Save RUN/checkpoints/step-N and keep the newest ``keep``; see the module
    docstring. Collective when there are several ranks: all call it at the same step."""
    from dlrm.parallel.distributed import DistInfo, all_gather_objects, barrier, broadcast_object
    from dlrm.checkpoint.faults import inject

    info = info or DistInfo()
    root = Path(run_dir) / CHECKPOINTS
    step = progress.global_step
    final = root / f"step-{step:09d}"
    partial = final.with_name(final.name + PARTIAL)
    if info.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for suffix in (PARTIAL, DELETING):  # saves or removals a kill cut short
            for stale in root.glob(f"step-*{suffix}"):
                shutil.rmtree(stale)
        partial.mkdir()
    barrier(info)
    state: dict[str, Any] = {"dense_optimizer": dense_opt.state_dict(), "rng": torch.get_rng_state()}
    plan = None
    embeddings = getattr(model, "embeddings", None)
    if embeddings is not None:
        from dlrm.models.dlrm import unwrap
        from dlrm.checkpoint.tables import save_embeddings

        host = getattr(embeddings, "host", None)  # Hotline: save the host tier, complete
        if host is not None:
            embeddings.sync_to_host()
        save_embeddings(partial / "embeddings", host if host is not None else embeddings)
        state["dense"] = unwrap(model.dense_arch).state_dict()
        plan = getattr(embeddings, "plan", None)
    else:  # torchrec backend: whole tables in state.pt (one process)
        state.update(model.export_state())
    inject("kill_after_shards", step, info.rank)
    if info.is_main:
        torch.save(state, partial / "state.pt")
    barrier(info)
    # Every rank hashes (and fsyncs) its share of the files; rank 0 writes the manifest.
    names = broadcast_object(_files_under(partial) if info.is_main else None, info)
    mine = {name: _digest(partial / name, fsync=True) for name in names[info.rank::info.world_size]}
    manifest = {k: v for part in all_gather_objects(mine, info) for k, v in part.items()}
    if info.is_main:
        meta = {
            "format_version": FORMAT_VERSION,
            "progress": dataclasses.asdict(progress),
            "config": config,
            "schema": schema_to_json(schema),
            "plan": json.loads(plan.to_json()) if hasattr(plan, "to_json") else None,
            "world_size": info.world_size,
            "files": dict(sorted(manifest.items())),
        }
        meta["meta_sha256"] = _meta_digest(meta)
        with open(partial / "meta.json", "w") as fh:
            fh.write(json.dumps(meta, indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        for d in {partial} | {(partial / n).parent for n in names}:
            _fsync_dir(d)
        inject("kill_before_rename", step, info.rank)
        if final.exists():  # put there by hand: replaced
            os.replace(final, final.with_name(final.name + DELETING))
        os.replace(partial, final)
        _fsync_dir(root)
        for old in checkpoints(run_dir, legacy=False)[keep:]:
            doomed = old.with_name(old.name + DELETING)
            os.replace(old, doomed)  # out of sight first: a kill mid-removal leaves no half checkpoint
            shutil.rmtree(doomed)
        for doomed in root.glob(f"step-*{DELETING}"):
            shutil.rmtree(doomed)
    barrier(info)
    return final


def _files_under(directory: Path) -> list[str]:
    return sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file())


def _digest(path: Path, fsync: bool = False) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex} of ``path``, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
        if fsync:
            os.fsync(fh.fileno())
        size = fh.tell()
    return {"bytes": size, "sha256": h.hexdigest()}


def _meta_digest(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


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


def find_resumable(run_dir: Path, info: Any = None, warn: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint of ``run_dir`` whose files verify (None if there is
    none), to resume from. A corrupt one is reported through ``warn`` and the one
    before it tried; once one verifies, the corrupt newer ones are moved aside
    (``step-N.corrupt``: no longer found, not counted among those kept, left to
    inspect). If all are corrupt, the newest one's error is raised and nothing
    moved. Another format version is raised at once: older checkpoints would not
    fit either. The same answer on every rank (rank 0 lists, all verify a share)."""
    from dlrm.parallel.distributed import DistInfo, barrier, broadcast_object

    info = info or DistInfo()
    corrupt: list[tuple[Path, CheckpointCorrupt]] = []
    for ckpt in broadcast_object(checkpoints(run_dir) if info.is_main else None, info):
        try:
            verify(ckpt, load_meta(ckpt), info)
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
        return ckpt
    if corrupt:
        raise corrupt[0][1]
    return None


# --------------------------------------------------------------------------- load


def load_checkpoint(
    ckpt: Path,
    model: torch.nn.Module,
    dense_opt: torch.optim.Optimizer | None,
    config: dict[str, Any] | None,
    schema: Schema,
    info: Any = None,
    verified: bool = False,
) -> Progress:
    """Restore ``model`` (and ``dense_opt``) from ``ckpt``; the progress to continue at.

    With ``config`` given, refuses a checkpoint of another model first; then checks
    every file against the manifest (unless ``verified``: :func:`find_resumable`
    did). Collective with several ranks (``info``)."""
    meta = load_meta(ckpt)
    if config is not None:
        check_compatible(meta, config, schema, ckpt)
    if not verified:
        verify(ckpt, meta, info)
    state = load_state(ckpt)
    try:
        embeddings = getattr(model, "embeddings", None)
        if embeddings is not None:
            from dlrm.models.dlrm import unwrap
            from dlrm.checkpoint.tables import load_embeddings

            missing, unexpected = unwrap(model.dense_arch).load_state_dict(state["dense"], strict=False)
            if missing or unexpected:
                raise KeyError(f"dense state: missing {missing[:1]}, unexpected {unexpected[:1]}")
            host = getattr(embeddings, "host", None)
            if host is not None:  # Hotline: load the host tier, then the hot rows from it
                load_embeddings(ckpt / "embeddings", host)
                embeddings.import_tables(host.export_tables())
            else:
                load_embeddings(ckpt / "embeddings", embeddings)
        else:
            model.import_state(state)
        if dense_opt is not None:
            dense_opt.load_state_dict(state["dense_optimizer"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} does not fit the model: {e}") from None
    torch.set_rng_state(state["rng"])
    return Progress(**meta["progress"])


def load_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of ``ckpt``, its own checksum and the format version checked."""
    path = Path(ckpt) / "meta.json"
    if not path.is_file():
        raise CheckpointCorrupt(f"checkpoint {path}: missing")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable ({_one_line(e)})") from None
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"checkpoint {path}: not a JSON object")
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_digest(meta):
        raise CheckpointCorrupt(f"checkpoint {path}: does not match its sha256 (corrupt or edited)")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: format version {version}, this program reads {FORMAT_VERSION} "
            "(written by another version; train into a new --out)"
        )
    if not isinstance(meta.get("files"), dict) or "meta_sha256" not in meta:
        raise CheckpointCorrupt(f"checkpoint {path}: no manifest of the checkpoint's files")
    return meta


def verify(ckpt: Path, meta: dict[str, Any], info: Any = None) -> None:
    """Check every file of the manifest (present, size, sha256); raise
    :class:`CheckpointCorrupt` naming the first bad one. With several ranks each
    hashes a share and all get the same verdict (a collective)."""
    from dlrm.parallel.distributed import DistInfo, all_gather_objects

    info = info or DistInfo()
    manifest = meta["files"]
    problem = None
    for name in sorted(manifest)[info.rank::info.world_size]:
        problem = _check_file(Path(ckpt), name, manifest[name])
        if problem:
            break
    problems = [p for p in all_gather_objects(problem, info) if p]
    if problems:
        raise CheckpointCorrupt(f"checkpoint {ckpt}: {problems[0]}")


def _check_file(ckpt: Path, name: str, want: Any) -> str | None:
    """Why file ``name`` of ``ckpt`` differs from its manifest entry, or None."""
    if Path(name).is_absolute() or ".." in Path(name).parts or not isinstance(want, dict):
        return f"manifest entry {name!r} is not a file of the checkpoint"
    path = ckpt / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != want.get("bytes"):
        return f"{name} is {size} bytes, the manifest says {want.get('bytes')} (truncated or overwritten)"
    if _digest(path)["sha256"] != want.get("sha256"):
        return f"{name} does not match its sha256 (corrupt: a changed byte)"
    return None


def load_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "state.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt, truncated or foreign files fail in many ways
        raise CheckpointError(f"checkpoint {path}: cannot be loaded ({_one_line(e)})") from None


def check_compatible(meta: dict[str, Any], config: dict[str, Any], schema: Schema, ckpt: Path) -> None:
    """Refuse a checkpoint whose model differs from the one this run builds."""
    saved_model = meta["config"]["model"]
    for key, value in config["model"].items():
        if saved_model.get(key) != value:
            raise CheckpointError(
                f"checkpoint {ckpt}: model.{key} is {saved_model.get(key)!r} there, {value!r} here"
            )
    for key in ("sparse", "pooling"):
        a = meta["config"]["optim" if key == "sparse" else "embeddings"][key]
        b = config["optim" if key == "sparse" else "embeddings"][key]
        if a != b:
            section = "optim" if key == "sparse" else "embeddings"
            raise CheckpointError(f"checkpoint {ckpt}: {section}.{key} is {a!r} there, {b!r} here")
    saved = schema_from_json(meta["schema"])
    if saved != schema:
        for name in ("label", "dense"):
            if getattr(saved, name) != getattr(schema, name):
                raise CheckpointError(f"checkpoint {ckpt}: schema {name} differs from the data's")
        raise CheckpointError(
            f"checkpoint {ckpt}: sparse features or table sizes differ from the data's "
            f"({_first_diff(saved, schema)})"
        )


def _first_diff(a: Schema, b: Schema) -> str:
    for fa, fb in zip(a.sparse, b.sparse):
        if fa != fb:
            return f"{fa.name}: {fa.rows} rows there, {fb.name}: {fb.rows} here"
    return f"{len(a.sparse)} sparse features there, {len(b.sparse)} here"


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
