"""A checkpoint's manifest: what makes it verifiable as it is loaded.

    meta.json   {"format_version": 4, "progress", "config", "schema", "plan",
                 "world_size", "files": {name: {"bytes", "sha256"}}, "meta_sha256"}

Loading checks meta.json's own sha256 and the format version (:func:`load_meta`),
that the checkpoint's model is this run's (:func:`check_compatible`), every file's
size (:func:`verify` without hashing), then each file's sha256 as the load reads it
(:func:`load_state` for state.pt; the tables in ``tables.py``): one read. ``state.pt``
is read with ``weights_only=True``: tensors, never code."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from data.errors import UserError, one_line
from data.schema import Schema, SparseFeature
from dlrm.parallel.distributed import DistInfo, all_gather_objects

FORMAT_VERSION = 4  # 4: the tables as raw pieces with index.json (3: torch.distributed.checkpoint)
HASH_THREADS = min(4, os.cpu_count() or 1)  # files hashed at a time by one rank


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt or made for another model."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files are missing, truncated or altered since it was saved."""


def schema_to_json(schema: Schema) -> dict[str, Any]:
    return dataclasses.asdict(schema)


def schema_from_json(d: dict[str, Any]) -> Schema:
    return Schema(
        label=d["label"],
        dense=tuple(d["dense"]),
        sparse=tuple(SparseFeature(**f) for f in d["sparse"]),
    )



def check_preprocessing(meta: dict[str, Any], ckpt: Path) -> None:
    """Refuse a checkpoint whose run's RUN/preprocessing.json is not the one it was
    trained with (its sha256 is in meta.json): the same value would map to other rows."""
    from data.preprocess import digest as preprocessing_digest

    want = meta.get("preprocessing")
    run_dir = Path(ckpt).parent.parent
    if want is not None and preprocessing_digest(run_dir) != want:
        raise CheckpointError(f"checkpoint {ckpt}: {run_dir}/preprocessing.json is missing or not "
                              "the one it was trained with (sha256 differs)")


def digest(path: Path, fsync: bool = False) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex} of ``path``, read through one 8 MiB buffer."""
    h = hashlib.sha256()
    buffer = memoryview(bytearray(8 << 20))
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while got := fh.readinto(buffer):
            h.update(buffer[:got])
            size += got
        if fsync:
            os.fsync(fh.fileno())
    return {"bytes": size, "sha256": h.hexdigest()}


class _Hashing:
    """A file object that hashes what is written through it."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha256, self.bytes = fh, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        self.bytes += memoryview(data).nbytes
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def save_digested(obj: Any, path: Path) -> dict[str, Any]:
    """``torch.save(obj, path)``, fsynced; its digest, hashed as it was written
    (no second read of what may be a large file)."""
    with open(path, "wb") as fh:
        out = _Hashing(fh)
        torch.save(obj, out)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}


def meta_digest(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def load_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of ``ckpt``, its own checksum and the format version checked."""
    path = Path(ckpt) / "meta.json"
    if not path.is_file():
        raise CheckpointCorrupt(f"checkpoint {path}: missing")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable ({one_line(e)})") from None
    if not isinstance(meta, dict):
        raise CheckpointCorrupt(f"checkpoint {path}: not a JSON object")
    if "meta_sha256" in meta and meta["meta_sha256"] != meta_digest(meta):
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


def verify(ckpt: Path, meta: dict[str, Any], info: Any = None, names: list[str] | None = None,
           hash_files: bool = True) -> None:
    """Check the files ``names`` (default: all) of the manifest (present, size, and
    with ``hash_files`` sha256); raise :class:`CheckpointCorrupt` naming the first
    bad one. With several ranks each checks a share and all get the same verdict
    (a collective)."""
    info = info or DistInfo()
    manifest = meta["files"]
    mine = sorted(manifest if names is None else names)[info.rank::info.world_size]
    with ThreadPoolExecutor(HASH_THREADS) as pool:  # sha256 and reads release the GIL
        found = list(pool.map(lambda name: check_file(Path(ckpt), name, manifest, hash_files), mine))
    gathered = all_gather_objects(first_verdicts(found), info)
    raise_verdicts(ckpt, gathered)


def check_file(ckpt: Path, name: str, manifest: dict[str, Any], hash_file: bool = True
               ) -> tuple[str | None, str | None]:
    """(why file ``name`` of ``ckpt`` differs from its entry in ``manifest``: missing,
    another size, another sha256; why it cannot be read: an I/O error), each or None.
    One file, this process: a caller hashing on threads of its own gathers the
    verdicts itself (:func:`first_verdicts`, :func:`raise_verdicts`). An unreadable file
    is a verdict, not an exception: raised on one rank before the gather, it left the
    other ranks waiting in it."""
    try:
        return _check_file(Path(ckpt), name, manifest.get(name), hash_file), None
    except OSError as e:
        return None, f"{name} cannot be read ({e.strerror or e})"


def first_verdicts(found: list[tuple[str | None, str | None]]) -> tuple[str | None, str | None]:
    """This rank's first difference and first read error among ``found``."""
    return (next((c for c, _ in found if c), None), next((u for _, u in found if u), None))


def raise_verdicts(ckpt: Path, gathered: list[tuple[str | None, str | None]]) -> None:
    """Every rank's verdicts: a read error first, as a CheckpointError (the storage failed,
    not the checkpoint: a resume must not move it aside as corrupt), else the first
    difference as a CheckpointCorrupt."""
    unreadable = next((u for _, u in gathered if u), None)
    if unreadable:
        raise CheckpointError(f"checkpoint {ckpt}: {unreadable}; nothing was moved or changed: "
                              "try again once the storage reads")
    corrupt = next((c for c, _ in gathered if c), None)
    if corrupt:
        raise CheckpointCorrupt(f"checkpoint {ckpt}: {corrupt}")


def _check_file(ckpt: Path, name: str, want: Any, hash_file: bool = True) -> str | None:
    """Why file ``name`` of ``ckpt`` differs from its manifest entry, or None."""
    if Path(name).is_absolute() or ".." in Path(name).parts or not isinstance(want, dict):
        return f"manifest entry {name!r} is not a file of the checkpoint"
    path = ckpt / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != want.get("bytes"):
        return f"{name} is {size} bytes, the manifest says {want.get('bytes')} (truncated or overwritten)"
    if hash_file and digest(path)["sha256"] != want.get("sha256"):
        return f"{name} does not match its sha256 (corrupt: a changed byte)"
    return None


def load_state(ckpt: Path, want: dict[str, Any] | None = None, info: Any = None) -> dict[str, Any]:
    """state.pt's tensors, mapped from the file (``torch.load(mmap=True)``): they
    use the page cache's pages instead of a private copy, and a model copies from
    them what it keeps. ``want``: its manifest entry; then rank 0 hashes the file
    through the same mapping before loading (the pages the load then uses: one read
    from disk), and a mismatch raises :class:`CheckpointCorrupt` on every rank
    before anything is loaded (a collective)."""
    path = ckpt / "state.pt"
    if want is not None:
        info = info or DistInfo()
        problem = None
        if info.is_main and _mapped_sha256(path) != want.get("sha256"):
            problem = "state.pt does not match its sha256 (corrupt: a changed byte)"
        problems = [p for p in all_gather_objects(problem, info) if p]
        if problems:
            raise CheckpointCorrupt(f"checkpoint {ckpt}: {problems[0]}")
    try:
        with warnings.catch_warnings():
            # A foreign pickle's protocol warning would precede the one-line refusal.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - corrupt, truncated or foreign files fail in many ways
        raise CheckpointError(f"checkpoint {path}: cannot be loaded ({one_line(e)})") from None


def _mapped_sha256(path: Path, window: int = 8 << 20) -> str | None:
    """sha256 of ``path`` read through read-only mappings of ``window`` bytes, each
    unmapped before the next (None if unreadable): the pages are left in the page
    cache for the load's own mapping, not held in this process."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            window -= window % mmap.ALLOCATIONGRANULARITY
            for start in range(0, size, window):
                with mmap.mmap(fh.fileno(), min(window, size - start), access=mmap.ACCESS_READ,
                               offset=start) as pages:
                    h.update(pages)
    except OSError:
        return None
    return h.hexdigest()


def check_compatible(meta: dict[str, Any], config: dict[str, Any], schema: Schema, ckpt: Path) -> None:
    """Refuse a checkpoint whose model differs from the one this run builds."""
    saved_model = meta["config"]["model"]
    for key, value in config["model"].items():
        if saved_model.get(key) != value:
            raise CheckpointError(
                f"checkpoint {ckpt}: model.{key} is {saved_model.get(key)!r} there, {value!r} here"
            )
    # the optimizers' states are saved for the optimizer that made them: another one
    # cannot take them (a dense one changed on resume was torch's KeyError traceback)
    for section, key in (("optim", "sparse"), ("optim", "dense"), ("embeddings", "pooling")):
        a, b = meta["config"][section].get(key), config[section][key]
        if a is not None and a != b:
            raise CheckpointError(f"checkpoint {ckpt}: {section}.{key} is {a!r} there, {b!r} here")
    saved = schema_from_json(meta["schema"])
    if saved != schema:
        for name, there, here in (("label", saved.label, schema.label),
                                  ("dense", saved.dense, schema.dense)):
            if there != here:
                raise CheckpointError(f"checkpoint {ckpt}: schema {name} differs from the data's")
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
        shrank = all(fb.rows <= fa.rows for fa, fb in zip(saved.sparse, schema.sparse, strict=False))
        hint = ("; the data's tables are smaller: identity tables are sized by the train and eval "
                "files' ids, so resume with the data.train and data.eval the run started with"
                if shrank and len(saved.sparse) == len(schema.sparse) else
                "; to go on with data whose tables grew, start a new run from this one: "
                f"--out NEW train.init_from={run}")
        raise CheckpointError(f"checkpoint {ckpt}: sparse features or table sizes differ from the "
                              f"data's ({_first_diff(saved, schema)}){hint}")


def _first_diff(a: Schema, b: Schema) -> str:
    for fa, fb in zip(a.sparse, b.sparse):
        if fa != fb:
            return f"{fa.name}: {fa.rows} rows there, {fb.name}: {fb.rows} here"
    return f"{len(a.sparse)} sparse features there, {len(b.sparse)} here"
