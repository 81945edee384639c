"""Checkpoints: kept on a schedule, verified before loading, never running code.

One short single-process run (checkpoints at steps 3, 6, 9 and 10, the last three
kept) is copied and damaged in every way the issue names: each damage is refused
with one line naming the file and why (exit 2), and a resume falls back from a
corrupt newest checkpoint to the one before it, ending where the undamaged run
ended. The 2-rank crash tests are in test_exactly_once.py.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dlrm.checkpoint import manager as ck
from dlrm.checkpoint import manifest
from dlrm.checkpoint.schedule import CheckpointSchedule
from dlrm.cli import main
from dlrm.parallel.distributed import DistInfo
from tests.conftest import REPO, TINY, needs_mount_namespace, tiny_overrides
from tests.data_helpers import tiny_dataset
from tests.multiprocess import run_ranks
from tests.run_state import run_state

STEPS = 10


def train_argv(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
            f"data.train={data}", "data.batch_size=128", "train.epochs=2",
            f"train.max_steps={STEPS}", "train.checkpoint_every=3", "train.keep_checkpoints=3", *extra]


def one_line_error(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("ckpt_safety")
    (root / "data").mkdir()
    tiny_dataset(root / "data", file_rows=(300, 170, 530, 41), row_group_rows=50)
    assert main(train_argv(root / "data", root / "run")) == 0
    return root / "data", root / "run", run_state(root / "run")


def steps_kept(run: Path) -> list[str]:
    return sorted(p.name for p in (run / ck.CHECKPOINTS).iterdir())


def test_schedule_keeps_the_newest_and_the_manifest_covers_every_file(trained) -> None:
    _, run, _ = trained
    # every 3 steps (3, 6, 9) and at the end (10); the 3 newest kept, nothing partial
    assert steps_kept(run) == ["step-000000006", "step-000000009", "step-000000010"]
    ckpt = ck.find_checkpoint(run)
    meta = manifest.load_meta(ckpt)
    files = {str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file()} - {"meta.json"}
    assert set(meta["files"]) == files
    assert {"state.pt", "embeddings/index.json"} < files and any(f.endswith(".bin") for f in files)
    for name, entry in meta["files"].items():
        assert entry["sha256"] == hashlib.sha256((ckpt / name).read_bytes()).hexdigest(), name
    assert meta["progress"]["global_step"] == STEPS and meta["config"]["train"]["max_steps"] == STEPS
    assert meta["format_version"] == manifest.FORMAT_VERSION and "meta_sha256" in meta


def test_checkpoint_seconds_saves_on_time(trained, tmp_path: Path) -> None:
    data, _, _ = trained
    # A clock this short is due after every step; 0 steps would never be.
    assert main(train_argv(data, tmp_path / "run", "train.max_steps=4", "train.checkpoint_every=0",
                           "train.checkpoint_seconds=0.000000001", "train.keep_checkpoints=10")) == 0
    assert steps_kept(tmp_path / "run") == [f"step-00000000{i}" for i in (1, 2, 3, 4)]


def _ranks_agree(rank: int, world_size: int) -> tuple[list[tuple[bool, int]], list[tuple[int, bool, int]]]:
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), "gloo")
    schedule = CheckpointSchedule(0, 1000.0, 2, info, exchange_seconds=0)  # exchange every step
    verdicts = []
    for late_rank in (0, 1):  # one rank's clock says "late", the other's does not
        schedule.saved_at = float("-inf") if rank == late_rank else float("inf")
        verdicts.append(tuple(schedule.after_step(step=7)))
    schedule.saved_at = float("inf")
    for signalled, signum in ((1, 15), (0, 2)):  # one rank got SIGTERM, then SIGINT
        verdicts.append(tuple(schedule.after_step(7, signum if rank == signalled else 0)))
    return verdicts, _stop_step(info, step_s=0.02)


def _stop_step(info: DistInfo, step_s: float) -> list[tuple[int, bool, int]]:
    """Steps of ``step_s`` seconds; rank 1 is signalled at step 5: every verdict to the stop."""
    schedule = CheckpointSchedule(4, 0.0, 2, info, exchange_seconds=0.2)
    verdicts = []
    for step in range(1, 1000):
        time.sleep(step_s)
        verdict = schedule.after_step(step, 15 if info.rank == 1 and step >= 5 else 0)
        verdicts.append((step, *verdict))
        if verdict.stop:
            return verdicts
    return verdicts


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_decide_alike() -> None:
    # Rank 0's clock decides for all ranks, and any rank's signal stops (and saves)
    # every rank at the same step: a save is a collective.
    (verdicts0, steps0), (verdicts1, steps1) = run_ranks(2, _ranks_agree)
    expected = [(True, 0), (False, 0), (True, 15), (True, 2)]
    assert verdicts0 == verdicts1 == expected
    # Exchanging about every 0.2 s (10 steps of 20 ms): the same verdicts on both
    # ranks, saves every 4 steps, and the stop after step 5 but within 0.2 s or so.
    assert steps0 == steps1
    stop_step, save, stop = steps0[-1]
    assert save and stop == 15 and 5 <= stop_step <= 5 + 11
    assert all(save == (step % 4 == 0) and not stop for step, save, stop in steps0[:-1])


def damaged_copy(run: Path, dst: Path, damage: str) -> tuple[Path, str, str]:
    """A copy of ``run`` whose newest checkpoint has ``damage``; (copy, file, reason)."""
    shutil.copytree(run, dst)
    ckpt = ck.find_checkpoint(dst)
    shard = next(p for p in (ckpt / "embeddings").iterdir() if p.suffix == ".bin")
    if damage == "bit_flip_in_shard":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
        return dst, f"embeddings/{shard.name}", "does not match its sha256"
    if damage == "truncated_state":
        state = ckpt / "state.pt"
        state.write_bytes(state.read_bytes()[:1000])
        return dst, "state.pt", "truncated"
    if damage == "missing_metadata":
        (ckpt / "embeddings" / "index.json").unlink()
        return dst, "embeddings/index.json", "is missing"
    if damage == "edited_meta":
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["progress"]["global_step"] = 3
        (ckpt / "meta.json").write_text(json.dumps(meta))
        return dst, "meta.json", "does not match its sha256"
    raise AssertionError(damage)


DAMAGES = ["bit_flip_in_shard", "truncated_state", "missing_metadata", "edited_meta"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_checkpoint_refused_naming_file_and_why(trained, tmp_path: Path, capsys,
                                                        damage: str) -> None:
    data, run, _ = trained
    copy, name, why = damaged_copy(run, tmp_path / "run", damage)
    ckpt = ck.find_checkpoint(copy)
    code = main(["eval", "--checkpoint", str(ckpt), "--data", str(data)])
    one_line_error(capsys, code, str(ckpt), name, why)
    # the run directory: eval takes the newest and does not fall back to an older model
    code = main(["eval", "--checkpoint", str(copy), "--data", str(data)])
    one_line_error(capsys, code, name, why)


def test_resume_falls_back_from_a_corrupt_newest_checkpoint(trained, tmp_path: Path, capsys) -> None:
    data, run, want = trained
    copy, name, _ = damaged_copy(run, tmp_path / "run", "bit_flip_in_shard")
    capsys.readouterr()
    assert main(train_argv(data, copy)) == 0  # resumes at step 9, runs step 10 again
    out = capsys.readouterr().out
    assert f"step-000000010: {name} does not match its sha256" in out, out
    assert "resumed from" in out and "step-000000009 at step 9" in out, out
    assert steps_kept(copy) == ["step-000000006", "step-000000009", "step-000000010",
                                "step-000000010.corrupt"]
    got = run_state(copy)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_resume_refused_when_every_checkpoint_is_corrupt(trained, tmp_path: Path, capsys) -> None:
    data, run, _ = trained
    shutil.copytree(run, tmp_path / "run")
    for ckpt in ck.checkpoints(tmp_path / "run"):
        (ckpt / "state.pt").write_bytes(b"")
    code = main(train_argv(data, tmp_path / "run"))
    one_line_error(capsys, code, "step-000000010", "state.pt is 0 bytes")
    assert len(ck.checkpoints(tmp_path / "run")) == 3  # nothing moved


def test_other_format_version_refused(trained, tmp_path: Path, capsys) -> None:
    data, run, _ = trained
    shutil.copytree(run, tmp_path / "run")
    ckpt = ck.find_checkpoint(tmp_path / "run")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["format_version"] = 99  # as a later program would write it, checksum and all
    meta["meta_sha256"] = manifest.meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code = main(train_argv(data, tmp_path / "run"))
    one_line_error(capsys, code, "meta.json", "format version 99, this program reads")
    # the layout of format 2 (RUN/checkpoint/) is found and refused, not ignored
    legacy = tmp_path / "old" / ck.LEGACY
    legacy.mkdir(parents=True)
    (legacy / "meta.json").write_text(json.dumps({"format_version": 2}))
    code = main(train_argv(data, tmp_path / "old"))
    one_line_error(capsys, code, "checkpoint/meta.json", "format version 2")


def test_other_model_config_refused(trained, tmp_path: Path, capsys) -> None:
    """Each refused, and the run's own files (config.yaml, schema.json, plan.json) left
    as its checkpoints were trained with: a refused resume rewrote them until 2026-12-07."""
    data, run, _ = trained
    shutil.copytree(run, tmp_path / "run")
    kept = {name: (tmp_path / "run" / name).read_bytes() for name in ("config.yaml", "schema.json")}
    code = main(train_argv(data, tmp_path / "run", "model.embedding_dim=8", "model.bottom_mlp=[8]"))
    one_line_error(capsys, code, "step-000000010", "model.embedding_dim is 16 there, 8 here")
    code = main(train_argv(data, tmp_path / "run", "optim.sparse=adam"))
    one_line_error(capsys, code, "optim.sparse is 'rowwise_adagrad' there, 'adam' here")
    # the dense optimizer's state is Adagrad's: Adam took it and stopped in torch's KeyError
    code = main(train_argv(data, tmp_path / "run", "optim.dense=adam"))
    one_line_error(capsys, code, "optim.dense is 'adagrad' there, 'adam' here")
    assert {name: (tmp_path / "run" / name).read_bytes() for name in kept} == kept


class _Payload:
    """Unpickling this runs ``Path.touch`` on a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_loading_never_runs_code_from_the_checkpoint(trained, tmp_path: Path, capsys) -> None:
    data, run, _ = trained
    shutil.copytree(run, tmp_path / "run")
    ckpt = ck.find_checkpoint(tmp_path / "run")
    marker = tmp_path / "code-ran"
    (ckpt / "state.pt").write_bytes(pickle.dumps({"rng": _Payload(marker)}))
    # a forger who also fixes the manifest gets past the checksums, not past weights_only
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"]["state.pt"] = manifest.digest(ckpt / "state.pt")
    meta["meta_sha256"] = manifest.meta_digest(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code = main(["eval", "--checkpoint", str(ckpt), "--data", str(data)])
    one_line_error(capsys, code, "state.pt", "cannot be loaded")
    assert not marker.exists()


# A full disk at a save, for real: a size-limited tmpfs in a mount namespace of its own
# (root only), filled to leave room for half a checkpoint.
_FULL_DISK = r'''
import json, os, shutil, subprocess, sys
disk, data, out, config = sys.argv[1:5]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", disk], check=True)
run = os.path.join(disk, "run")
def train(steps, every=5, out=run):
    cmd = [sys.executable, "-m", "dlrm", "train", "--config", config, "--out", out,
           f"data.train={data}", "data.eval=", "train.progress=false", "data.batch_size=64",
           f"train.max_steps={steps}", f"train.checkpoint_every={every}", "train.log_every=1"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    saved = os.path.join(out, "checkpoints")
    return {"code": p.returncode, "err": p.stderr,
            "checkpoints": sorted(os.listdir(saved)) if os.path.isdir(saved) else []}
def fill(leave):
    with open(os.path.join(disk, "ballast"), "wb") as f:
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(disk).free - leave)
first = train(10)
ckpt = os.path.join(run, "checkpoints", "step-000000010")
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
fill(size // 2)
full = train(20)
os.remove(os.path.join(disk, "ballast"))
again = train(20)
fill(32768)  # the metrics log runs out mid-run (no checkpoint before the end)
logging = train(400, every=1000, out=os.path.join(disk, "run2"))
lines = open(os.path.join(disk, "run2", "metrics.jsonl")).read().splitlines()
logging["whole_lines"] = all(json.loads(x) is not None for x in lines)
fill(0)  # nothing left: the run's first file
start = train(10, out=os.path.join(disk, "run3"))
json.dump({"first": first, "full": full, "again": again, "logging": logging, "start": start}, open(out, "w"))
'''


@pytest.mark.slow
@needs_mount_namespace
def test_a_full_disk_is_one_line_and_leaves_the_checkpoints_before_it_whole(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    tiny_dataset(data, file_rows=(2000,), row_group_rows=500)
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "result.json"
    proc = subprocess.run(["unshare", "-m", sys.executable, "-c", _FULL_DISK, str(disk), str(data), str(out),
                           str(TINY)], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0 and "mount" in proc.stderr and not out.exists():
        pytest.skip(f"no tmpfs here: {proc.stderr.strip().splitlines()[-1]}")
    result = json.loads(out.read_text())
    assert result["first"]["code"] == 0 and result["first"]["checkpoints"] == ["step-000000005", "step-000000010"]
    full = result["full"]
    lines = [x for x in full["err"].splitlines() if x.strip()]
    assert full["code"] == 2 and len(lines) == 1 and "Traceback" not in full["err"], full["err"][-3000:]
    assert "cannot be written" in lines[0] and "No space left on device" in lines[0]
    assert "the checkpoints before it are kept" in lines[0]
    # the failed save's half is gone (it only filled the disk); the one before is whole
    assert full["checkpoints"] == ["step-000000005", "step-000000010"]
    again = result["again"]
    assert again["code"] == 0, again["err"][-3000:]
    assert again["checkpoints"] == ["step-000000015", "step-000000020"]
    # a full disk elsewhere than a checkpoint: the file named in one line, no traceback
    for case, name in (("logging", "run2/metrics.jsonl"), ("start", "run3/preprocessing.json")):
        err = result[case]["err"]
        assert result[case]["code"] == 2 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f"dlrm train: error: cannot write {disk / name}: No space left on device; "
            "0 B free on its file system")
    assert result["logging"]["whole_lines"]  # the line being written when it ran out is gone
