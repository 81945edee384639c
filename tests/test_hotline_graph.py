"""hotline.graph_step (dlrm/train/hotline_graph.py): Hotline's whole step static.

Without a GPU the static step runs uncaptured, on the Triton kernels in Triton's
interpreter: its buffers, the two-tier lookup, the hot rows' update in the kernel
and the cold rows' gradient sent home must train exactly as ordinary training (the
reference: the same run with every table on one device). On a GPU the same tests
capture and replay it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernel_cases import DEVICE  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)

pytest.importorskip("triton")

from tests.run_state import RTOL, assert_states_close, run_state
from tests.test_hotline_train import run

# a budget of about a tenth of the rows: most samples have a cold lookup
STATIC = ("embeddings.placement=hotline", "hotline.budget=160KB", "embeddings.kernels=triton",
          "hotline.graph_step=on", "data.batch_size=64")


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "rowwise_adagrad", "adam"])
def test_static_hotline_step_equals_ordinary_training(tiny_data, tmp_path: Path, optim: str) -> None:
    """3 eager warm-up steps, then static ones (single-hot tiny data: every batch fits)."""
    steps = ("train.max_steps=7", f"optim.sparse={optim}", "optim.dense=adam")  # adam: capturable
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=64")
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC)
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), f"static hotline {optim}",
                        RTOL.get(optim, 1e-5))
    assert summary["step_mode"].startswith("hotline step static: 4 steps"), summary["step_mode"]
    stats = summary["hotline"]
    assert stats["hot_hit_rate"] < 0.9 and stats["popular_share"] < 0.5  # cold rows staged and sent home
