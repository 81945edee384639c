"""Metrics for long runs: the TensorBoard scalars (train.tensorboard=true) hold what
RUN/metrics.jsonl holds, and ``dlrm plot RUN`` draws the jsonl's series to a PNG."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dlrm.cli import main
from dlrm.config import ConfigError
from dlrm.eval.curves import read_curves, write_curves
from dlrm.train.meter import JsonLog
from tests.conftest import TINY, tiny_overrides

# What TensorBoard must show, as "event/key" (Hotline's stats among them).
WANTED = ("train/loss", "train/samples_per_s", "eval/auc", "eval/logloss",
          "hotline/hot_hit_rate", "hotline/popular_share", "hotline/gather_hidden")


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def series(run: Path, event: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the ``event`` records of metrics.jsonl."""
    return [(r["step"], r[key]) for r in records(run) if r["event"] == event]


@pytest.fixture(scope="module")
def hotline_run(tiny_data, tmp_path_factory) -> Path:
    """A short Hotline run that logs every 3 steps, evaluates every 4, with TensorBoard."""
    run = tmp_path_factory.mktemp("curves") / "run"
    board = importlib.util.find_spec("tensorboard") is not None  # else the plot test alone runs
    assert main(["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
                 f"data.train={tiny_data['train']}", f"data.eval={tiny_data['eval']}",
                 "train.max_steps=8", "train.log_every=3", "train.eval_every=4",
                 f"train.tensorboard={str(board).lower()}", "embeddings.placement=hotline",
                 "hotline.budget=560KB"]) == 0
    return run


@pytest.mark.slow
def test_tensorboard_holds_the_jsonl_scalars(hotline_run: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install tensorboard (in the test extras)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(hotline_run / "tensorboard"))
    board.Reload()
    assert set(WANTED) <= set(board.Tags()["scalars"])
    for tag in WANTED:
        event, key = tag.split("/")
        want = series(hotline_run, event, key)
        got = [(e.step, e.value) for e in board.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want] and want, tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag  # float32
    steps = [s for s, _ in series(hotline_run, "eval", "auc")]
    assert steps == [4, 8]  # eval_every=4 and the end of the run (step 8 once)


@pytest.mark.slow
def test_plot_draws_the_jsonl_series(hotline_run: Path, tmp_path: Path, capsys) -> None:
    import matplotlib.image

    capsys.readouterr()
    assert main(["plot", str(hotline_run)]) == 0
    said = json.loads(capsys.readouterr().out)
    png = hotline_run / "curves.png"
    assert said == {"out": str(png), "train_points": 3, "eval_points": 2}  # steps 3, 6 and the last, 8
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (900, 800) and pixels.std() > 0.05  # drawn, not blank

    path, drawn = write_curves(hotline_run, tmp_path / "elsewhere.png")
    assert path == tmp_path / "elsewhere.png" and path.stat().st_size > 10_000
    assert drawn.loss == series(hotline_run, "train", "loss")
    assert drawn.samples_per_s == series(hotline_run, "train", "window_samples_per_s")
    assert drawn.eval_auc == series(hotline_run, "eval", "auc")
    assert drawn.eval_logloss == series(hotline_run, "eval", "logloss")
    assert drawn.run_rate == records(hotline_run)[-1]["samples_per_s"]
    assert main(["plot", str(hotline_run), "--out", str(tmp_path)]) == 0  # a directory: curves.png in it
    assert (tmp_path / "curves.png").is_file()


def write_lines(run: Path, lines: list[str]) -> None:
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("\n".join(lines))


def train_line(step: int, loss: float) -> str:
    return json.dumps({"event": "train", "step": step, "loss": loss, "samples_per_s": 10.0,
                       "window_samples_per_s": 20.0 + step})


def test_resumed_and_cut_files(tmp_path: Path, capsys) -> None:
    """A resumed run logs a step again (the later record wins); a kill cuts the last
    line short (left out); a bad line elsewhere, a missing file or one without training
    records are one line naming the file, exit 2."""
    run = tmp_path / "run"
    write_lines(run, [train_line(2, 0.9), train_line(4, 0.8), train_line(2, 0.7),
                      json.dumps({"event": "eval", "step": 4, "auc": 0.6, "logloss": 0.5}), '{"event": "tr'])
    curves = read_curves(run)
    assert curves.loss == [(2, 0.7), (4, 0.8)] and curves.samples_per_s == [(2, 22.0), (4, 24.0)]
    assert curves.eval_auc == [(4, 0.6)] and curves.run_rate is None

    cases = {
        "bad": ([train_line(2, 0.9), "oops", train_line(4, 0.8)], "metrics.jsonl:2: not a JSON record"),
        "empty": ([json.dumps({"event": "eval", "step": 4, "auc": 0.6, "logloss": 0.5})], "no training records"),
    }
    for name, (lines, message) in cases.items():
        write_lines(tmp_path / name, lines)
        assert main(["plot", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, name
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_tensorboard_rank_zero_only_and_missing_package(tmp_path: Path, monkeypatch) -> None:
    JsonLog(tmp_path / "metrics.jsonl", enabled=False, tensorboard=True).write({"event": "train", "step": 1})
    assert not (tmp_path / "tensorboard").exists()  # other ranks write nothing
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        JsonLog(tmp_path / "metrics.jsonl", enabled=False, tensorboard=True)


def test_a_run_shorter_than_log_every_logs_its_last_window(tiny_data, tmp_path: Path, capsys) -> None:
    """Before, a 5-step run at log_every=50 logged no loss and `dlrm plot` had nothing to
    draw ("no training records yet"); the last step now logs its window: the mean of the
    steps' losses, as a log line at log_every=5 gives (the reference run)."""
    def run(out: Path, every: int) -> list[dict]:
        assert main(["train", "--config", str(TINY), "--out", str(out), *tiny_overrides(),
                     f"data.train={tiny_data['train']}", "data.eval=", "train.max_steps=5",
                     f"train.log_every={every}", "data.batch_size=256"]) == 0
        return [r for r in records(out) if r["event"] == "train"]

    short, reference = run(tmp_path / "short", 50), run(tmp_path / "every5", 5)
    assert [r["step"] for r in short] == [r["step"] for r in reference] == [5]
    assert short[0]["loss"] == reference[0]["loss"]
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "short")]) == 0
    assert json.loads(capsys.readouterr().out)["train_points"] == 1
