"""The cold-read bench's page-cache probe and drop, against util-linux's ``fincore``
(an independent count of a file's resident pages), and its figures' arithmetic."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dlrm.bench.cold_read import cold_read, drop, resident


def _fincore_pages(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "PAGES,SIZE", str(path)],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0])


def _file(tmp_path: Path, mb: int = 4) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * (mb << 12))
    return path


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")
def test_resident_share_matches_fincore_and_drop_empties_it(tmp_path: Path) -> None:
    path = _file(tmp_path)
    path.read_bytes()  # in the cache
    share = resident([str(path)])
    if share is None:
        pytest.skip("mincore not available")
    pages = -(-path.stat().st_size // 4096)
    assert share == pytest.approx(_fincore_pages(path) / pages, abs=0.02)
    drop([str(path)])
    if _fincore_pages(path) == pages:
        pytest.skip("this file system keeps the pages (fadvise ignored)")
    assert resident([str(path)]) == pytest.approx(_fincore_pages(path) / pages, abs=0.02)
    assert resident([str(path)]) < 0.05


def test_cold_read_figures(tmp_path: Path) -> None:
    path = _file(tmp_path, 2)
    calls = []

    def read() -> dict:
        calls.append(1)
        return {"rows": 1000, "rows_per_s": 123.0}

    c = cold_read([str(path)], read)
    assert calls == [1] and c["reader_rows_per_s"] == 123.0
    assert c["bytes"] == path.stat().st_size
    seconds = c["bytes"] / (c["disk_mb_s"] * 1e6)
    assert c["disk_rows_per_s"] == pytest.approx(1000 / seconds)
