"""A checkpoint file that cannot be read (an I/O error, not a changed byte): every rank
stops with the same CheckpointError naming it, none waits in the verdicts' gather, and
it is not called corrupt (a resume would move a checkpoint the storage may read again
aside). Before, the rank that checked the file raised before the gather and the others
waited there until the collective timeout. The error is injected by making the hash of
one file raise EIO on the one rank that checks it."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from dlrm.checkpoint import manifest
from dlrm.checkpoint.manager import find_checkpoint
from dlrm.checkpoint.manifest import CheckpointCorrupt, CheckpointError, load_meta, verify
from dlrm.cli import main
from dlrm.parallel.distributed import init_distributed
from tests.conftest import TINY, tiny_overrides
from tests.multiprocess import run_ranks


@pytest.fixture(scope="module")
def ckpt(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("unreadable") / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run),
                 *tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": "", "train.max_steps": 2})]) == 0
    return find_checkpoint(run)


def _verify_with_eio(rank: int, world_size: int, ckpt: Path, bad: str) -> str:
    """verify() on this rank, the hash of ``bad`` failing with EIO on rank 1 (its checker)."""
    info = init_distributed("gloo", "cpu")
    real = manifest.digest

    def failing(path: Path, *args, **kwargs):
        if rank == 1 and Path(path).name == Path(bad).name:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, *args, **kwargs)

    manifest.digest = failing
    return _outcome(lambda: verify(ckpt, load_meta(ckpt), info))


def _outcome(check) -> str:
    """What ``check()`` ended with, as one comparable line per rank."""
    try:
        check()
    except CheckpointCorrupt as e:
        return f"corrupt: {e}"
    except CheckpointError as e:
        return str(e)
    return "passed"


@pytest.mark.distributed
def test_an_unreadable_file_stops_every_rank_with_one_line(ckpt: Path) -> None:
    names = sorted(load_meta(ckpt)["files"])
    bad = names[1]  # the second name: rank 1 checks it (each rank checks names[rank::2])
    lines = run_ranks(2, _verify_with_eio, ckpt, bad, timeout=120)
    assert lines[0] == lines[1], lines
    assert f"{bad} cannot be read (Input/output error); nothing was moved or changed" in lines[0], lines
    assert list(ckpt.parent.glob("*.corrupt")) == []


def _load_with_index_eio(rank: int, world_size: int, ckpt: Path) -> str:
    """The checkpoint loaded into a two-rank model, tables/index.json failing with EIO on
    rank 1 alone (its node's storage), as it is read for the tables."""
    import pathlib

    from dlrm.checkpoint.manager import load_checkpoint
    from dlrm.config import Config, from_dict
    from dlrm.parallel.parallelize import build_model

    info = init_distributed("gloo", "cpu")
    meta = load_meta(ckpt)
    schema = manifest.schema_from_json(meta["schema"])
    model = build_model(from_dict(Config, meta["config"], ""), schema, "cpu", info)
    real = pathlib.Path.read_bytes

    def failing(path: pathlib.Path) -> bytes:
        if rank == 1 and path.name == "index.json":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    pathlib.Path.read_bytes = failing
    return _outcome(lambda: load_checkpoint(ckpt, model, None, None, schema, info))


@pytest.mark.distributed
def test_an_index_one_rank_cannot_read_stops_every_rank(ckpt: Path) -> None:
    """Read by every rank before the load's first collective: the rank that failed
    raised alone before, and the other waited in the hashers' all-gather."""
    lines = run_ranks(2, _load_with_index_eio, ckpt, timeout=120)
    assert lines[0] == lines[1], lines
    assert "index.json is unreadable" in lines[0] and "Input/output error" in lines[0], lines
