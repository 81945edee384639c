"""Checkpoints of a run: atomic, loadable without executing code, checked on load.

    RUN/checkpoint/meta.json     format version, progress, config, schema (rank 0)
    RUN/checkpoint/state.pt      tensors only (torch.load weights_only=True): dense
                                 model, dense optimizer, RNG (rank 0)
    RUN/checkpoint/embeddings/   torch.distributed.checkpoint: every rank writes its
                                 own shards; loads into any world size and plan

A save writes ``checkpoint.tmp`` completely, then swaps it in by renames; a crash
at any moment leaves a complete ``checkpoint`` or ``checkpoint.old`` to resume from.
With several nodes the run directory must be on a shared file system.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.errors import UserError
from data.schema import Schema, SparseFeature

FORMAT_VERSION = 2


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt or made for another model."""


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


def save_checkpoint(
    run_dir: Path,
    model: torch.nn.Module,
    dense_opt: torch.optim.Optimizer,
    progress: Progress,
    config: dict[str, Any],
    schema: Schema,
    info: Any = None,
) -> Path:
    """Collective when there are several ranks: all ranks call it at the same step."""
    from dlrm.distributed import DistInfo, barrier

    info = info or DistInfo()
    run_dir = Path(run_dir)
    final, tmp, old = run_dir / "checkpoint", run_dir / "checkpoint.tmp", run_dir / "checkpoint.old"
    if info.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier(info)
    state: dict[str, Any] = {"dense_optimizer": dense_opt.state_dict(), "rng": torch.get_rng_state()}
    embeddings = getattr(model, "embeddings", None)
    if embeddings is not None:
        from dlrm.model import unwrap
        from dlrm.sharded_checkpoint import save_embeddings

        host = getattr(embeddings, "host", None)  # Hotline: save the host tier, complete
        if host is not None:
            embeddings.sync_to_host()
        save_embeddings(tmp / "embeddings", host if host is not None else embeddings)
        state["dense"] = unwrap(model.dense_arch).state_dict()
    else:  # torchrec backend: whole tables in state.pt (one process)
        state.update(model.export_state())
    barrier(info)
    if info.is_main:
        torch.save(state, tmp / "state.pt")
        meta = {
            "format_version": FORMAT_VERSION,
            "progress": dataclasses.asdict(progress),
            "config": config,
            "schema": schema_to_json(schema),
            "world_size": info.world_size,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
        if old.exists():
            shutil.rmtree(old)
    barrier(info)
    return final


def load_checkpoint(
    ckpt: Path,
    model: torch.nn.Module,
    dense_opt: torch.optim.Optimizer | None,
    config: dict[str, Any] | None,
    schema: Schema,
) -> Progress:
    """Restore ``model`` (and ``dense_opt``) from ``ckpt``; the progress to continue at.

    With ``config`` given, refuses a checkpoint of another model first."""
    meta = load_meta(ckpt)
    if config is not None:
        check_compatible(meta, config, schema, ckpt)
    state = load_state(ckpt)
    try:
        embeddings = getattr(model, "embeddings", None)
        if embeddings is not None:
            from dlrm.model import unwrap
            from dlrm.sharded_checkpoint import load_embeddings

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


def find_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``run_dir`` (or a checkpoint dir itself)."""
    run_dir = Path(run_dir)
    if (run_dir / "meta.json").is_file():
        return run_dir
    for name in ("checkpoint", "checkpoint.old"):
        cand = run_dir / name
        if (cand / "meta.json").is_file() and (cand / "state.pt").is_file():
            return cand
    return None


def load_meta(ckpt: Path) -> dict[str, Any]:
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt / 'meta.json'}: unreadable ({e})") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt}: format version {version}, this program reads {FORMAT_VERSION}"
        )
    return meta


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
