"""A checkpoint's save and resume need a fixed buffer, not a second copy of the tables.

The bench's two phases (dlrm/bench/checkpoint.py), each in a fresh process so its
high-water mark is its own, on a model of 4 tables x 300k rows x 64 (307 MB):

    save      peak RSS during save_checkpoint − RSS before it
    resume    peak RSS during build (no random init) + load (verified as read) − RSS after it;
              the build leaves the tables' pages untouched, the load fills them

Both must stay within 10% of the model state plus 64 MiB: the format's buffers are
16 MiB per file in flight. Writing through torch.distributed.checkpoint, as before,
copied every table (+100%), and so would any per-table staging copy. The tables'
float64 sum after the resume equals the saved one: the empty build was filled.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm.bench.checkpoint import checkpoint_bench

MIB = 2**20
MODEL = ["generate.sparse=4", "generate.table_rows=[300000]", "optim.sparse=rowwise_adagrad"]


@pytest.mark.slow
def test_save_and_resume_peak_rss_within_a_fixed_buffer(tmp_path: Path) -> None:
    r = checkpoint_bench("configs/bench.yaml", MODEL, tmp_path, dd_mbytes=32)
    state = r["state_bytes"]
    assert 300e6 < state < 320e6, state  # 4 x 300k x 64 float32 weights + Adagrad sums
    bound = state // 10 + 64 * MIB
    save, resume = r["save"], r["resume"]
    assert save["overhead"] <= bound, f"save: +{save['overhead'] / MIB:.0f} MiB over the model"
    assert resume["overhead"] <= bound, f"resume: +{resume['overhead'] / MIB:.0f} MiB over the model"
    # The resume built the tables without touching them (no random init), and the
    # load filled them once, in place.
    assert 0.95 * state <= resume["rss_after"] - resume["rss_built"] <= state + bound
    assert resume["tables_sum"] == save["tables_sum"]
    assert save["disk_bytes"] >= state and save["gb_s"] > 0 and resume["gb_s"] > 0
    assert not (tmp_path / "checkpoint-bench").exists()  # cleaned up
