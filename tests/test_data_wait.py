"""The run summary's data-wait share, and the warning naming the reader above 10%."""

from __future__ import annotations

from dlrm.parallel.distributed import DistInfo
from dlrm.train.meter import Meter


def _meter(waits: list[float], seconds: float = 1.0, warmup: int = 2) -> Meter:
    meter = Meter(DistInfo(), time_sections=False, warmup=warmup)
    for step, wait in enumerate(waits, start=1):
        meter.add_step(step, 10, seconds, wait, 0.5, 0.1)
    return meter


def test_share_counts_timed_steps_only_and_warns_above_ten_percent() -> None:
    meter = _meter([0.9, 0.9, 0.1, 0.3])  # the first two are warm-up
    assert meter.summary()["data_wait_share"] == (0.1 + 0.3) / 2
    warning = meter.reader_warning()
    assert warning is not None and "reader" in warning and "20%" in warning
    quiet = _meter([0.9, 0.9, 0.1, 0.1])
    assert quiet.data_wait_share == 0.1 and quiet.reader_warning() is None
    assert _meter([0.5]).data_wait_share == 0.0  # no timed step yet
