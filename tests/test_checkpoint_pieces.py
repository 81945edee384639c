"""A piece file holds exactly the tensor's bytes, whichever way it was written.

``write_piece`` goes past the page cache (O_DIRECT, an aligned buffer, the tail
padded then truncated) where the file system allows it, and through the cache where
it does not (tmpfs); both must give the tensor's raw bytes and their sha256, for
sizes that are not a multiple of the alignment or that cross the buffer.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dlrm.checkpoint.pieces import DIRECT_BYTES, read_overlap, write_piece

SHM = Path("/dev/shm")
PLACES = ["disk"] + (["tmpfs"] if SHM.is_dir() and os.access(SHM, os.W_OK) else [])


@pytest.fixture(params=PLACES)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "disk":
        yield tmp_path
        return
    d = SHM / f"pieces-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


@pytest.mark.parametrize("shape", [(1000, 7), (DIRECT_BYTES // 4 + 1234, 1), (1, 1)])
def test_piece_bytes_and_hash(where: Path, shape: tuple[int, int]) -> None:
    t = torch.randn(*shape)
    d = write_piece(where / "p.bin", t)
    raw = (where / "p.bin").read_bytes()
    assert raw == t.numpy().tobytes()
    assert d == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    # and back into part of a wider tensor: rows 3.., columns 2..2+cols, through the buffer
    dest = torch.zeros(shape[0] + 3, shape[1] + 4)
    filled = read_overlap(where / "p.bin", ((3, 2), shape), dest, (0, 0))
    assert filled == t.numel() and torch.equal(dest[3:, 2 : 2 + shape[1]], t)
    dest[3:, 2 : 2 + shape[1]] = 0
    assert not dest.any()  # nothing else written
