"""``dlrm export``: a serving copy of a run's model, and reading one back to score it.

    dlrm export --checkpoint RUN --out DIR --tables int8|stored

    DIR/export.json      {"format": "hybrid-dlrm-export", "version": 1, "tables": "int8" | "stored",
                          "step": N, "config": the run's config, "schema": its schema,
                          "table_meta": {table: {"rows", "dim", "dtype": int8|fp32|fp16|bf16}},
                          "table_bytes": bytes of every table as stored here,
                          "files": {name: {"bytes", "sha256"}}}
    DIR/dense.pt         the dense part (bottom MLP, interaction, top MLP): a state_dict
    DIR/tables.pt        {table: {"q": uint8 [rows, dim], "scale_bias": float32 [rows, 2]}}  (int8)
                         {table: {"weight": [rows, dim] in the table's dtype}}            (stored)
    DIR/preprocessing.json, DIR/preprocessing/  the run's, when it had any (ids → rows)

Every table whole, no optimizer state. int8 (embeddings/int8.py): each row its own
scale and bias, value = q * scale + bias: dim + 8 bytes a row (fbgemm's fused 8-bit
row-wise values, scale and bias kept apart). The .pt files hold tensors only
(``torch.load(weights_only=True)``) and are checked against their sha256 when read.

The copy is written in a hidden directory beside DIR and renamed to DIR at the end:
a failure leaves nothing at DIR. DIR must not exist, or be an empty directory.

``dlrm eval --checkpoint DIR`` scores an export as it scores a run: the int8 tables
are dequantised into fp32 tables (the values a serving lookup of them gives).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from data.errors import UserError
from data.preprocess import FILE as PREP_FILE
from data.preprocess import VOCAB_DIR
from dlrm.checkpoint.manager import (
    CHECKPOINTS,
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    prune_after_read,
)
from dlrm.checkpoint.manifest import digest, load_meta, save_digested, schema_from_json
from dlrm.checkpoint.mapped import release
from dlrm.checkpoint.readers import reading
from dlrm.config import Config, from_dict
from dlrm.parallel.distributed import DistInfo
from embeddings.int8 import dequantize_into, int8_bytes, quantize_rows
from embeddings.interface import TableState
from embeddings.rounding import weight_dtype

EXPORT_FILE = "export.json"
FORMAT = "hybrid-dlrm-export"
VERSION = 1
PREP_FILES = (PREP_FILE, VOCAB_DIR)  # the run's names (an export of a run with vocabularies
# once left its vocabulary files behind, and `dlrm eval` of it stopped: "missing or altered")


def is_export(path: str | Path) -> bool:
    return (Path(path) / EXPORT_FILE).is_file()


def export_run(run: str | Path, out: str | Path, tables: str = "int8") -> dict[str, Any]:
    """Write the serving copy of ``run``'s newest checkpoint to ``out``; its export.json."""
    run, out = Path(run), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not empty; name a new directory")
    with reading(run, find_checkpoint, then=prune_after_read) as ckpt:  # a run still training keeps it while it is read
        if ckpt is None:
            raise CheckpointError(f"no checkpoint in {run} (expected {run}/{CHECKPOINTS}/step-N/meta.json)")
        return _export(run, ckpt, out, tables)


def _export(run: Path, ckpt: Path, out: Path, tables: str) -> dict[str, Any]:
    from dlrm.eval.model import eval_model

    meta = load_meta(ckpt)
    cfg: Config = from_dict(Config, meta["config"], "")
    if cfg.embeddings.backend != "native":
        raise UserError(f"checkpoint {ckpt}: embeddings.backend={cfg.embeddings.backend}; "
                        "dlrm export reads runs of the native backend")
    schema = schema_from_json(meta["schema"])
    info = DistInfo()  # one process: every table whole
    cfg = _serving(cfg, placement="sharded")
    # quiet: nothing is scored here, and export.json keeps the run's config (its kernels)
    model = eval_model(cfg, schema, info, say=lambda _: None)
    load_checkpoint(ckpt, model, None, None, schema, info)
    dense, held = model.state_for_checkpoint()
    assert held is not None  # native: tables apart from state.pt
    body, table_tensors = _tables(whole_tables(held), held.tables, tables)
    body.update({"format": FORMAT, "version": VERSION, "tables": tables, "step": meta.get("progress", {}).get("global_step"),
                 "config": meta["config"], "schema": meta["schema"], "source": str(ckpt)})
    _write(out, body, dense["dense"], table_tensors, ckpt.parent.parent if meta.get("preprocessing") else None)
    return body


def whole_tables(state: TableState) -> dict[str, torch.Tensor]:
    """Every table's weight whole, in its dtype, from one process's shards of it: the
    live tensor itself where one shard is the whole table (no second copy of a table
    near the memory size), else assembled."""
    rows = {spec.name: (spec.rows, spec.dim) for spec in state.tables}
    out = {}
    for shard, tensors in state.held:
        if tuple(tensors["weight"].shape) == rows[shard.table] and shard.row_start == shard.col_start == 0:
            out[shard.table] = tensors["weight"]
    for spec in state.tables:
        if spec.name not in out:
            whole = torch.empty(spec.rows, spec.dim, dtype=weight_dtype(spec.dtype))
            for shard, tensors in state.held:
                if shard.table == spec.name:
                    whole[shard.row_start : shard.row_end, shard.col_start : shard.col_end] = tensors["weight"]
            out[spec.name] = whole
    return out


def _tables(weights: dict[str, torch.Tensor], specs: list[Any], kind: str) -> tuple[dict, dict]:
    """(export.json's table_meta and table_bytes, tables.pt's content)."""
    table_meta, tensors, nbytes = {}, {}, 0
    for spec in specs:
        weight = weights[spec.name]
        if kind == "int8":  # the model is dropped after: each chunk's pages go back at once
            q, scale_bias = quantize_rows(weight, after_chunk=release)
            tensors[spec.name] = {"q": q, "scale_bias": scale_bias}
            dtype, size = "int8", int8_bytes(spec.rows, spec.dim)
        else:
            tensors[spec.name] = {"weight": weight}
            dtype, size = spec.dtype, weight.numel() * weight.element_size()
        table_meta[spec.name] = {"rows": spec.rows, "dim": spec.dim, "dtype": dtype}
        nbytes += size
    return {"table_meta": table_meta, "table_bytes": nbytes}, tensors


def _write(out: Path, body: dict, dense: dict, tables: dict, prep_dir: Path | None) -> None:
    """Everything into a hidden directory beside ``out``, then one rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        files = {"dense.pt": save_digested(dense, tmp / "dense.pt"),
                 "tables.pt": save_digested(tables, tmp / "tables.pt")}
        for name in PREP_FILES if prep_dir is not None else ():
            src = prep_dir / name
            if src.is_dir():
                shutil.copytree(src, tmp / name)
            elif src.is_file():
                shutil.copy2(src, tmp / name)
        (tmp / EXPORT_FILE).write_text(json.dumps({**body, "files": files}, indent=1))
        if out.exists():
            out.rmdir()  # empty (checked first)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_export(path: str | Path) -> tuple[dict[str, Any], Config]:
    """export.json of an export and the config to score it with: tables as they will be
    held (int8: fp32 after dequantising), no optimizer state, one plain placement."""
    path = Path(path)
    try:
        body = json.loads((path / EXPORT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"export {path / EXPORT_FILE}: unreadable ({str(e).splitlines()[0]})") from None
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CheckpointError(f"export {path / EXPORT_FILE}: not a {FORMAT} version {VERSION}")
    cfg: Config = from_dict(Config, body["config"], "")
    return body, _serving(cfg, "sharded", {t: ("fp32" if m["dtype"] == "int8" else m["dtype"])
                                            for t, m in body["table_meta"].items()})


def _serving(cfg: Config, placement: str, dtypes: dict[str, str] | None = None) -> Config:
    """``cfg`` for scoring: plain placement; ``dtypes`` per table when given."""
    emb = dataclasses.replace(cfg.embeddings, placement=placement)  # type: ignore[arg-type]
    if dtypes is not None:
        kinds = set(dtypes.values())
        emb = dataclasses.replace(emb, dtype=kinds.pop() if len(kinds) == 1 else "fp32", dtypes=dtypes,
                                  state_dtype="fp32")
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, sparse="sgd"))
    return dataclasses.replace(cfg, embeddings=emb)


def load_export(path: str | Path, body: dict[str, Any], model: Any) -> None:
    """Fill ``model`` (built from :func:`read_export`'s config, any world size) with the
    export's dense part and tables, each file checked against its sha256 first."""
    path = Path(path)
    for name in ("dense.pt", "tables.pt"):
        if not (path / name).is_file() or digest(path / name)["sha256"] != body["files"][name]["sha256"]:
            raise CheckpointError(f"export {path / name}: missing or altered since it was written (sha256)")
    dense = torch.load(path / "dense.pt", map_location="cpu", weights_only=True)
    # mapped: a table's pages are read as its rows are filled, and given back after
    tables = torch.load(path / "tables.pt", map_location="cpu", weights_only=True, mmap=True)

    def fill(state: TableState) -> None:
        for shard, tensors in state.held:
            whole = tables[shard.table]
            rows, cols = slice(shard.row_start, shard.row_end), slice(shard.col_start, shard.col_end)
            with torch.no_grad():
                if "q" in whole:  # a chunk at a time: no fp32 copy of the table
                    dequantize_into(tensors["weight"], whole["q"][rows, cols], whole["scale_bias"][rows],
                                    after_chunk=release)
                else:
                    tensors["weight"].copy_(whole["weight"][rows, cols])
                    release(whole["weight"])

    model.restore({"dense": dense}, fill)
