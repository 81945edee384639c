"""A resume reads each checkpoint byte once: it verifies what it loads as it loads it.

    read_overlap(sha)   a piece a rank needs only part of is read whole, once, in
                        order: the part copied out, every byte hashed
    resume              bytes read (rchar of /proc/self/io) ≈ the checkpoint's size,
                        not twice it as with a verifying pass before the load
    corrupt piece       found after the tables are loaded: the older checkpoint is
                        loaded over the half-loaded model, and every tensor (dense,
                        tables, optimizer states, RNG) ends equal to the older one

Reference values: hashlib over the file's bytes, plain tensor slicing, and the
model's own tensors snapshotted when each checkpoint was saved.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from dlrm.bench.checkpoint import _model, read_chars, tables_sum
from dlrm.checkpoint import manager as ck
from dlrm.checkpoint.pieces import read_overlap, write_piece
from dlrm.config import to_dict

CONFIG = "configs/bench.yaml"
# 4 tables x 5000 rows x 64 float32 and their Adagrad sums: 5.2 MB, so the JSON files
# (meta.json, index.json) are a small share of what a resume reads; dense Adam has
# state to restore.
MODEL = ["generate.sparse=4", "generate.table_rows=[5000]", "optim.sparse=rowwise_adagrad", "optim.dense=adam"]


def test_partial_piece_is_read_and_hashed_once(tmp_path: Path) -> None:
    key = torch.randn(3000, 40)
    path = tmp_path / "rank-0.0.bin"
    written = write_piece(path, key[1000:2600])  # the piece: rows 1000-2599 of the key
    want_sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert written["sha256"] == want_sha
    # A block of rows 1500-2999, columns 8-31: part of the piece's rows and columns.
    dest = torch.zeros(1500, 24)
    sha = hashlib.sha256()
    before = read_chars()
    filled = read_overlap(path, ((1000, 0), (1600, 40)), dest, (1500, 8), sha)
    read = read_chars() - before
    assert filled == 1100 * 24
    assert torch.equal(dest[:1100], key[1500:2600, 8:32]) and not dest[1100:].any()
    assert sha.hexdigest() == want_sha
    assert path.stat().st_size <= read <= path.stat().st_size + 64 * 1024, read
    # Whole rows of the piece into a contiguous block: read straight in, hashed too.
    whole, sha = torch.zeros(1600, 40), hashlib.sha256()
    assert read_overlap(path, ((1000, 0), (1600, 40)), whole, (1000, 0), sha) == 1600 * 40
    assert torch.equal(whole, key[1000:2600]) and sha.hexdigest() == want_sha


def test_resume_reads_each_checkpoint_byte_once(tmp_path: Path) -> None:
    cfg, schema, model, opt = _model(CONFIG, MODEL, resume=False)
    ckpt = ck.save_checkpoint(tmp_path, model, opt, ck.Progress(global_step=1), to_dict(cfg), schema)
    disk = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    pieces = sum(f.stat().st_size for f in (ckpt / "embeddings").glob("*.bin"))
    # state.pt (the MLPs and their Adam state) is mapped, not read(2): not in rchar.
    read_through_calls = disk - (ckpt / "state.pt").stat().st_size
    assert pieces > 0.9 * read_through_calls and pieces > 5e6
    cfg, schema, fresh, fresh_opt = _model(CONFIG, MODEL, resume=True)
    before = read_chars()
    found = ck.resume_checkpoint(tmp_path, fresh, fresh_opt, to_dict(cfg), schema, warn=print)
    read = read_chars() - before
    assert found is not None and found[0] == ckpt and found[1].global_step == 1
    assert tables_sum(fresh) == tables_sum(model)
    # Every piece once; a verifying pass before the load read every file twice.
    assert pieces <= read <= 1.05 * read_through_calls, (read, read_through_calls)


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    dense, tables = model.state_for_checkpoint()
    out = {f"dense.{k}": v.clone() for k, v in dense["dense"].items()}
    for i, (shard, held) in enumerate(tables.held):
        out.update({f"tables.{i}.{shard.table}.{k}": v.clone() for k, v in held.items()})
    for i, state in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    out["rng"] = torch.get_rng_state()
    return out


def _step_dense(model, opt) -> None:
    for p in model.dense_parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def test_corrupt_piece_falls_back_and_overwrites_every_tensor(tmp_path: Path) -> None:
    cfg, schema, model, opt = _model(CONFIG, MODEL, resume=False)
    _step_dense(model, opt)  # the dense optimizer has state to save
    older = ck.save_checkpoint(tmp_path, model, opt, ck.Progress(global_step=1), to_dict(cfg), schema)
    want = _snapshot(model, opt)
    with torch.no_grad():  # the newer checkpoint differs in every element of every tensor
        for p in model.dense_parameters():
            p.add_(1.0)
        for _, held in model.state_for_checkpoint()[1].held:
            for t in held.values():
                t.add_(1.0)
        for state in opt.state.values():
            for t in state.values():
                t.add_(1.0)
    torch.rand(5)  # and the RNG moved on
    newer = ck.save_checkpoint(tmp_path, model, opt, ck.Progress(global_step=2), to_dict(cfg), schema)
    newest_piece = max((newer / "embeddings").glob("*.bin"), key=lambda f: f.name)
    data = bytearray(newest_piece.read_bytes())
    data[-3] ^= 0x01  # one bit of one piece: found only once that piece is read
    newest_piece.write_bytes(bytes(data))
    cfg, schema, fresh, fresh_opt = _model(CONFIG, MODEL, resume=True)
    said: list[str] = []
    found = ck.resume_checkpoint(tmp_path, fresh, fresh_opt, to_dict(cfg), schema, warn=said.append)
    assert found is not None and found[0] == older and found[1].global_step == 1
    assert f"embeddings/{newest_piece.name} does not match its sha256" in said[0], said
    got = _snapshot(fresh, fresh_opt)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert (tmp_path / ck.CHECKPOINTS / (newer.name + ck.CORRUPT)).is_dir()
