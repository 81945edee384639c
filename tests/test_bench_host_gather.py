"""``python -m dlrm.bench.host_gather``: the cold gather timed alone, per pages and threads."""

from __future__ import annotations

import json

import pytest

from dlrm.bench import host_gather
from tests.conftest import REPO
from tests.test_huge_pages import MODE, grants_huge_pages_now


def test_one_line_per_pages_way_and_threads_with_the_kernels_page_share(capsys) -> None:
    """A 77 MB table (big enough to be advised): huge, then small pages, each torch's
    index_select and ours at 1 and 2 threads; the huge-page share read back from the
    kernel (none where only advised memory gets them and this one was not)."""
    code = host_gather.main(["--config", str(REPO / "configs" / "bench_gpu.yaml"), "--rows", "300000",
                             "--lookups", "500", "--threads", "1,2", "--repeat", "3"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["pages"], r["way"], r["threads"]) for r in lines] == [
        (pages, way, n) for pages in ("huge", "small") for way in ("torch", "ours") for n in (1, 2)]
    for r in lines:
        assert (r["rows"], r["dim"], r["lookups"], r["busy"]) == (300_000, 64, 500, 0)
        assert r["ms"] > 0 and r["gb_per_s"] == pytest.approx(500 * 64 * 4 / r["ms"] / 1e6)
        assert r["p90_ms"] >= r["ms"] and r["mean_ms"] > 0
        assert r["huge_page_share"] is None or 0.0 <= r["huge_page_share"] <= 1.0
    if MODE == "madvise":
        assert lines[4]["huge_page_share"] == 0.0
    if MODE in ("madvise", "always") and grants_huge_pages_now():
        assert lines[0]["huge_page_share"] > 0.25


@pytest.mark.parametrize("rows,n", [(10, 10), (1000, 300), (10_000_000, 4500)])
def test_the_ids_are_distinct_sorted_rows_of_the_table(rows: int, n: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = host_gather._distinct(rows, n, gen)
    assert ids.numel() == n == len(set(ids.tolist()))
    assert ids.tolist() == sorted(ids.tolist()) and 0 <= int(ids.min()) and int(ids.max()) < rows


def test_a_table_smaller_than_the_lookups_gathers_each_row_once(capsys) -> None:
    assert host_gather.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--rows", "1000",
                             "--threads", "1", "--repeat", "2", "--ways", "ours"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["lookups"] for r in lines] == [1000, 1000]


def test_busy_processes_run_beside_the_gather_and_are_gone_after(capsys) -> None:
    import os

    before = set(os.listdir("/proc"))
    assert host_gather.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--rows", "1000",
                             "--threads", "1", "--repeat", "2", "--ways", "torch", "--busy", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["way"], r["busy"]) for r in lines] == [("torch", 2), ("torch", 2)]
    children = [p for p in set(os.listdir("/proc")) - before if p.isdigit()
                and _parent(p) == os.getpid()]
    assert children == []


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def test_an_unknown_way_is_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        host_gather.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--ways", "numpy"])
    assert exit_.value.code == 2 and "--ways numpy: torch, ours or both" in capsys.readouterr().err
