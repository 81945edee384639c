"""``train.keep_best`` and ``train.early_stop`` (dlrm/train/best.py). The reference is
the run's own record: the evals RUN/metrics.jsonl holds, read back and put through the
rule in plain Python (the best so far, the evals since it), and ``dlrm eval`` of the kept
checkpoint, which must score what the run logged at that step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from dlrm.config import ConfigError, load_config
from dlrm.eval.curves import write_curves
from dlrm.eval.evaluate import evaluate_checkpoint
from dlrm.train import trainer as trainer_mod
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.multiprocess import run_ranks

# logloss climbs within a few evals at this rate (the tables overfit 40k rows), so an
# early stop is due well before max_steps
SETTINGS = {"train.max_steps": 60, "train.eval_every": 3, "train.keep_best": "true",
            "train.early_stop": 2, "train.best_metric": "logloss", "train.keep_checkpoints": 1,
            "optim.sparse_lr": 0.5, "data.batch_size": 256, "data.eval_batch_size": 4096}


def _cfg(tiny_data, **extra: object):
    return load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"],
                                                "data.eval": tiny_data["eval"], **SETTINGS, **extra}))


def _evals(run: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["event"] == "eval"}


def _rule(evals: dict[int, dict], patience: int) -> tuple[int, int]:
    """(best step, the step the run stops at) by lowest logloss, in plain Python."""
    best_step, since = None, 0
    for step in sorted(evals):
        if best_step is None or evals[step]["logloss"] < evals[best_step]["logloss"]:
            best_step, since = step, 0
        else:
            since += 1
            if since == patience:
                return best_step, step
    raise AssertionError(f"no early stop in {sorted(evals)}")


def test_early_stop_ends_the_run_where_the_rule_says_and_keeps_the_best(tiny_data, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(_cfg(tiny_data), run, echo=lambda s: None)
    evals = _evals(run)
    best_step, stop_step = _rule(evals, 2)
    assert max(evals) == stop_step < 60 and best_step < stop_step - 3  # the rule fired, later evals ran
    assert summary["early_stopped"] == summary["steps"] == stop_step
    assert summary["best"] == {"metric": "logloss", "value": evals[best_step]["logloss"], "step": best_step,
                               "checkpoint": f"step-{best_step:09d}"}
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["best.json", f"step-{best_step:09d}", f"step-{stop_step:09d}"]  # keep 1, and the best
    scored = evaluate_checkpoint(run / "checkpoints" / f"step-{best_step:09d}", str(tiny_data["eval"]))
    assert scored["logloss"] == pytest.approx(evals[best_step]["logloss"], rel=1e-12)
    again = train(_cfg(tiny_data), run, echo=lambda s: None)  # the same command: finished, trains none
    assert again["trained_steps"] == 0 and again["best"] == summary["best"]
    curves = write_curves(run)[1]  # dlrm plot draws both lines from the summary
    assert (curves.best, curves.early_stop) == (summary["best"], stop_step)


def test_a_final_eval_out_of_patience_is_no_early_stop(tiny_data, tmp_path: Path) -> None:
    """max_steps set to the straight run's stop step: the same evals, the last of them the
    run's final one, which used up the patience. The run trained every step it was given,
    yet its summary said early_stopped and its rerun 'the run stopped early'."""
    straight = train(_cfg(tiny_data), tmp_path / "straight", echo=lambda s: None)
    stop = straight["early_stopped"]
    run = tmp_path / "run"
    summary = train(_cfg(tiny_data, **{"train.max_steps": stop}), run, echo=lambda s: None)
    assert summary["steps"] == summary["trained_steps"] == stop and summary["best"] == straight["best"]
    assert "early_stopped" not in summary
    lines: list[str] = []
    again = train(_cfg(tiny_data, **{"train.max_steps": stop}), run, echo=lines.append)
    assert again["trained_steps"] == 0 and "early_stopped" not in again
    assert any(f"nothing trained: the run was already complete at step {stop} of {stop}" in x for x in lines), lines


@pytest.mark.slow
def test_a_preempted_run_resumes_with_its_best_and_stops_at_the_same_step(tiny_data, tmp_path: Path,
                                                                        monkeypatch) -> None:
    straight = train(_cfg(tiny_data), tmp_path / "straight", echo=lambda s: None)
    step = trainer_mod.Trainer.step
    stop_at = straight["best"]["step"] + 3  # after the best, before the early stop

    def step_then_signal(self, batches):
        done = step(self, batches)
        if self.progress.global_step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return done

    monkeypatch.setattr(trainer_mod.Trainer, "step", step_then_signal)
    run = tmp_path / "stopped"
    assert train(_cfg(tiny_data), run, echo=lambda s: None).get("preempted") == "SIGTERM"
    monkeypatch.setattr(trainer_mod.Trainer, "step", step)
    resumed = train(_cfg(tiny_data), run, echo=lambda s: None)
    assert (resumed["early_stopped"], resumed["best"]) == (straight["early_stopped"], straight["best"])


def test_a_run_stopped_between_the_best_save_and_its_mark_keeps_the_best(tiny_data, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """The process dies after the improving eval's checkpoint is saved and before best.json
    names it; the resumed run must name it and keep it as the run never stopped does (it
    kept the eval before's, and pruned the best one at the next save)."""
    straight = train(_cfg(tiny_data), tmp_path / "straight", echo=lambda s: None)
    mark = trainer_mod.mark

    def dies_at_the_best(best, run_dir, keep, info):
        if best.step == straight["best"]["step"]:
            raise KeyboardInterrupt("killed before best.json is written")
        mark(best, run_dir, keep, info)

    monkeypatch.setattr(trainer_mod, "mark", dies_at_the_best)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_data), run, echo=lambda s: None)
    monkeypatch.setattr(trainer_mod, "mark", mark)
    resumed = train(_cfg(tiny_data), run, echo=lambda s: None)
    best = straight["best"]
    assert (resumed["early_stopped"], resumed["best"]) == (straight["early_stopped"], best)
    assert json.loads((run / "checkpoints" / "best.json").read_text())["checkpoint"] == best["checkpoint"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        p.name for p in (tmp_path / "straight" / "checkpoints").iterdir())


def _train_on_rank(rank: int, world_size: int, tiny_data: dict, run: Path) -> dict:
    return train(_cfg(tiny_data), run, echo=lambda s: None)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_stop_together_at_their_logs_rule(tiny_data, tmp_path: Path) -> None:
    run = tmp_path / "run"
    first, second = run_ranks(2, _train_on_rank, tiny_data, run)
    best_step, stop_step = _rule(_evals(run), 2)
    assert first["early_stopped"] == second["early_stopped"] == stop_step
    assert first["best"]["step"] == best_step
    assert (run / "checkpoints" / f"step-{best_step:09d}" / "meta.json").is_file()


@pytest.mark.parametrize("extra,words", [
    ({"data.eval": ""}, "config key train.early_stop=2: needs an eval set"),
    ({"train.eval_every": 0}, "config key train.early_stop=2: counts evals: set train.eval_every"),
    ({"data.eval": "", "train.early_stop": 0}, "config key train.keep_best=True: needs an eval set"),
])
def test_settings_without_evals_to_go_by_are_one_line(tiny_data, extra: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        _cfg(tiny_data, **extra)


def test_a_resume_past_a_corrupt_best_checkpoint_drops_best_json(tiny_data, tmp_path: Path) -> None:
    """best.json named the newest checkpoint; a resume found it corrupt, moved it aside
    (``step-N.corrupt``) and loads the one before, which no eval precedes: best.json must
    not go on naming the moved checkpoint (``dlrm eval`` of it would fail). The resumed
    run's own evals name the best again as they come."""
    from dlrm.parallel.distributed import DistInfo
    from dlrm.train.best import best_eval

    cfg = _cfg(tiny_data, **{"train.max_steps": 4, "train.eval_every": 4, "train.checkpoint_every": 2,
                             "train.keep_checkpoints": 2, "train.early_stop": 0})
    run = tmp_path / "run"
    train(cfg, run, echo=lambda s: None)
    checkpoints = run / "checkpoints"
    best_json = checkpoints / "best.json"
    named = json.loads(best_json.read_text())["checkpoint"]
    newest = max(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))
    assert named == newest  # the step-4 eval, the run's only one
    (checkpoints / named).rename(checkpoints / f"{named}.corrupt")  # as the resume moves it
    best = best_eval(cfg, run, DistInfo(), resumed_step=2)
    assert best.record()["checkpoint"] is None and not best_json.exists()
    resumed = train(cfg, run, echo=lambda s: None)  # steps 3-4 again, their eval names it anew
    assert json.loads(best_json.read_text())["checkpoint"] == resumed["best"]["checkpoint"] == named
