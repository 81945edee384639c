"""python -m dlrm.bench.kernels: one JSON line per kernel path, the work it timed."""

from __future__ import annotations

import json

import pytest

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from dlrm.bench.kernels import main
from tests.conftest import TINY


def test_kernel_bench_reports_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(TINY), "--calls", "1", "--kernels", "triton,torch",
                 "--device", str(DEVICE), "data.batch_size=8", "generate.sparse=3", "generate.multi_hot=0"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kernels"] for r in rows] == ["triton", "torch"]
    from embeddings.kernels.sparse_update import SEGMENT  # 32 unless DLRM_KERNEL_RUN_SEGMENT says

    assert [r["run_segment"] for r in rows] == [SEGMENT, None]
    for r in rows:
        assert r["tables"] == 3 and r["lookups"] == 3 * 8 and r["rows"] == 3 * 1000
        assert 0 < r["distinct_rows"] <= r["lookups"]
        assert 1 <= r["longest_run"] <= 8 and r["lookups"] - r["longest_run"] + 1 >= r["distinct_rows"]
        assert r["table_bytes"] == 3 * 1000 * 16 * 4
        assert r["forward_gbps"] > 0 and r["backward_update_gbps"] > 0
