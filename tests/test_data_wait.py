"""The run's meter: the data-wait share and the warning naming the reader above 10%;
samples/s as wall time up to where the host waited for the device (a queued GPU step
costs the host microseconds), warm-up and eval/checkpoint time left out."""

from __future__ import annotations

import pytest

from dlrm.parallel.distributed import DistInfo
from dlrm.train.meter import Meter


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _meter(waits: list[float], seconds: float = 1.0, warmup: int = 2) -> Meter:
    clock = Clock()
    meter = Meter(DistInfo(), time_sections=False, warmup=warmup, clock=clock)
    for step, wait in enumerate(waits, start=1):
        started = clock.now
        clock.now += seconds
        meter.add_step(step, 10, started, wait, 0.5, 0.1)
    return meter


def test_share_counts_timed_steps_only_and_warns_above_ten_percent() -> None:
    meter = _meter([9, 9, 1, 3], seconds=10)  # the first two are warm-up
    assert meter.summary()["data_wait_share"] == (1 + 3) / 20
    warning = meter.reader_warning("more data.workers")
    assert warning is not None and "reader" in warning and "20%" in warning
    assert warning.endswith("(above 10%); more data.workers")
    near = _meter([9, 9, 1.04, 1.04], seconds=10)
    near.close_span()
    assert "10.4% of step time" in (near.reader_warning() or "")
    quiet = _meter([9, 9, 1, 1], seconds=10)
    quiet.close_span()
    assert quiet.data_wait_share == 0.1 and quiet.reader_warning() is None
    assert _meter([0.5]).data_wait_share == 0.0  # no timed step yet


def test_a_short_runs_waits_are_not_a_warning() -> None:
    """20% of step time, but 0.4 s in all (the Avazu sample's 64 steps waited 0.1 s,
    mostly at its two epochs' starts): nothing to act on."""
    short = _meter([0.9, 0.9, 0.1, 0.3])
    short.close_span()
    assert short.data_wait_share == pytest.approx(0.2) and short.reader_warning() is None
    longer = _meter([0.9, 0.9, *[0.2] * 6])  # 1.2 s in all
    longer.close_span()
    assert longer.reader_warning() is not None


def test_rate_counts_the_wait_for_queued_work_not_the_steps_host_time() -> None:
    """Steps queued in 1 ms each whose work ends 2 s later (the device's queue drained
    when the log line reads the loss): 10 timed steps of 10 rows in ~2 s, 5 rows/s,
    where summing the steps' host time gives 1,000 rows/s."""
    clock = Clock()
    meter = Meter(DistInfo(), time_sections=False, warmup=1, clock=clock)
    for step in range(1, 12):
        started = clock.now
        clock.now += 0.001
        meter.add_step(step, 10, started, 0.0, 0.001, 0.0)
        if step == 1:
            clock.now += 5.0  # after the warm-up's span closed, before the next fetch: no span's
    first_timed = 100.0 + 0.001 + 5.0
    clock.now = first_timed + 2.0
    window = meter.take_window()
    assert meter.rate == pytest.approx(100 / 2.0)
    assert window["window_samples_per_s"] == pytest.approx(110 / (0.001 + 2.0))
    clock.now += 60.0  # an eval: the trainer closes the span before it, nothing open
    meter.close_span()
    started = clock.now
    clock.now += 1.0
    meter.add_step(12, 10, started, 0.0, 1.0, 0.0)
    assert meter.summary()["samples_per_s"] == pytest.approx(110 / 3.0)


def test_a_wait_while_the_device_still_ran_is_hidden() -> None:
    """Steps whose batch arrived while the device still ran the previous one (a queued
    GPU step) waited on the host only: ``host_wait_share`` counts them, the share the
    warning reads does not. Timed steps: waits 0.3 (device busy) and 0.2 (idle)."""
    clock = Clock()
    meter = Meter(DistInfo(), time_sections=False, warmup=1, clock=clock)
    for step, (wait, idle) in enumerate([(0.9, True), (0.3, False), (0.2, True)], start=1):
        started = clock.now
        clock.now += 1.0
        meter.add_step(step, 10, started, wait, 0.5, 0.1, device_idle=idle)
    summary = meter.summary()
    assert summary["data_wait_share"] == pytest.approx(0.2 / 2)
    assert summary["host_wait_share"] == pytest.approx((0.3 + 0.2) / 2)
    assert meter.reader_warning() is None  # 10%: not above
    assert Meter(DistInfo(), time_sections=False).device_idle()  # a CPU step is done when it returns


@pytest.mark.gpu
def test_cuda_device_idle_sees_queued_work() -> None:
    """On CUDA the meter asks an event behind the last step: not idle while its work
    runs, idle once it has finished (no wait either way)."""
    import torch

    meter = Meter(DistInfo(device=torch.device("cuda")), time_sections=False)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):  # ~tens of ms of queued work
        a = a @ a
        a = a / a.norm()
    meter.step_queued()
    assert not meter.device_idle()
    torch.cuda.synchronize()
    assert meter.device_idle()


def test_a_resumed_run_warms_up_again(tiny_data, tmp_path, monkeypatch) -> None:
    """The warm-up is a run's first steps, resumed runs included: a resume's first
    steps (the reader's first window, cold caches) were timed when the meter counted
    global steps (a 31-step resume of a 470-step run said 61% data wait and named the
    reader; counted from its own start, the same resume is warm-up then timed steps)."""
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import TINY, tiny_overrides

    seen: list[int] = []
    add_step = Meter.add_step
    monkeypatch.setattr(Meter, "add_step", lambda self, step, *rest: seen.append(step) or add_step(self, step, *rest))

    def run(steps: int) -> tuple[dict, list[str]]:
        said: list[str] = []
        cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": "",
                                                  "train.max_steps": steps, "train.timing_warmup": 2}))
        return train(cfg, tmp_path / "run", echo=said.append), said

    run(4)
    resumed, said = run(6)  # 2 steps: both warm-up
    assert seen == [1, 2, 3, 4, 1, 2]
    assert resumed["samples_per_s"] == 0.0
    assert any("(2 in this run), all within the train.timing_warmup=2 untimed ones" in s for s in said), said
    resumed, said = run(9)  # 3 steps: 2 warm-up, 1 timed
    assert seen[6:] == [1, 2, 3] and resumed["samples_per_s"] > 0


def test_the_warning_names_the_knob_with_this_runs_value() -> None:
    from data.decode_workers import available_cores
    from dlrm.config import load_config
    from dlrm.train.inputs import reader_remedy
    from tests.conftest import TINY

    cores = available_cores()
    none = reader_remedy(load_config(TINY, ["data.workers=0"]))
    assert none == f"decode in worker processes beside the step: data.workers=N (0 in this run; {cores} cores here)"
    two = reader_remedy(load_config(TINY, ["data.workers=2"]))
    assert two == f"more data.workers where cores are free (2 in this run; {cores} cores here)"
