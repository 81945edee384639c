"""``python -m dlrm.bench.gil_handoff``: a helper thread's task beside a loop of small torch ops."""

from __future__ import annotations

import json
import sys

from dlrm.bench import gil_handoff


def test_one_row_per_interval_and_ops_with_the_step_bounding_its_parts(capsys) -> None:
    before = sys.getswitchinterval()
    code = gil_handoff.main(["--ops", "0,50", "--intervals", "5,0.5", "--rounds", "5", "--elements", "20000"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["switch_interval_ms"], r["ops"]) for r in rows] == [(5.0, 0), (5.0, 50), (0.5, 0), (0.5, 50)]
    # each step waits for both its loop and its helper: so do the medians
    assert all(r["step_ms"] >= r["loop_ms"] and r["step_ms"] >= r["helper_ms"] > 0 for r in rows), rows
    assert all(r["helper_alone_ms"] > 0 for r in rows)
    assert sys.getswitchinterval() == before  # restored
