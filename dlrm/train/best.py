"""The run's best eval: ``train.keep_best`` keeps its checkpoint, ``train.early_stop``
ends the run when the evals stop improving on it.

    evals (auc)   0.71   0.74   0.76   0.75   0.758  0.755      early_stop=3
    step          100    200    300    400    500    600
    best          *      *      *                               best: step 300
    since best    0      0      0      1      2      3  ──► the run ends at step 600
    keep_best     save   save   save                            step-300 is never pruned

An eval improves when its ``train.best_metric`` is better than every one before it
(auc higher, logloss lower; a tie is no improvement). With ``keep_best`` the run saves
a checkpoint at that step (if none was saved there) and names it in
RUN/checkpoints/best.json (``{"metric", "value", "step", "checkpoint"}``), which the
pruning of ``keep_checkpoints`` passes over; the checkpoint named before is then pruned
like any other. ``dlrm eval / export / predict --checkpoint RUN/checkpoints/step-N``
take it.

Every rank holds the same metrics (an eval gathers all ranks' scores), so every rank
takes the same decisions. A resumed run replays the evals RUN/metrics.jsonl holds up to
its step (rank 0 reads, every rank learns it): the best and the count since it carry
over a preemption, and a run that had stopped early resumes as finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrm.checkpoint.manager import BEST, CHECKPOINTS, best_checkpoint, mark_best
from dlrm.parallel.distributed import DistInfo, broadcast_object

HIGHER_IS_BETTER = {"auc": True, "logloss": False}


@dataclass
class BestEval:
    """The best eval so far by ``metric`` and the evals since it."""

    metric: str
    patience: int  # train.early_stop (0: off)
    keep: bool  # train.keep_best
    value: float | None = None
    step: int | None = None
    since: int = 0  # evals since the best one

    @property
    def active(self) -> bool:
        return self.keep or self.patience > 0

    @property
    def stopped(self) -> bool:
        """Whether the evals stopped improving for ``patience`` in a row."""
        return self.patience > 0 and self.since >= self.patience

    def after_eval(self, step: int, metrics: dict[str, Any]) -> bool:
        """Count the eval at ``step``; whether it improved on the best."""
        value = float(metrics[self.metric])
        better = self.value is None or (value > self.value if HIGHER_IS_BETTER[self.metric]
                                        else value < self.value)
        if better:
            self.value, self.step, self.since = value, step, 0
        else:
            self.since += 1
        return better

    def record(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "step": self.step,
                "checkpoint": f"step-{self.step:09d}" if self.keep and self.step is not None else None}

    def stop_line(self, step: int, run_dir: Path) -> str:
        where = (f"; its checkpoint: {Path(run_dir) / CHECKPOINTS / self.record()['checkpoint']}"
                 if self.keep else "")
        return (f"early stop at step {step}: {self.since} evals in a row did not improve on "
                f"{self.metric} {self.value:.6f} (step {self.step}){where}")


def best_eval(cfg: Any, run_dir: Path, info: DistInfo, resumed_step: int | None) -> BestEval:
    """The run's tracker; a resumed one replays RUN/metrics.jsonl's evals up to its step."""
    t = cfg.train
    best = BestEval(t.best_metric, t.early_stop, t.keep_best)
    if not best.active or resumed_step is None:
        return best
    evals = list(logged_evals(run_dir / "metrics.jsonl", resumed_step).items()) if info.is_main else None
    for step, metrics in broadcast_object(evals, info) or []:
        best.after_eval(step, metrics)
    _mark_again(best, run_dir, t.keep_checkpoints, info)
    return best


def _mark_again(best: BestEval, run_dir: Path, keep_checkpoints: int, info: DistInfo) -> None:
    """A run stopped between an improving eval's save and its mark (a crash, a kill):
    best.json still names the eval before, and the pruning would take the best one's
    checkpoint. The replayed best is named now, where its checkpoint is there.

    A resume that fell back past a corrupt checkpoint (moved aside, ``step-N.corrupt``)
    replays only the evals before it: where best.json named that one and no eval before
    it is left to name, best.json goes (it named a checkpoint that is not there; the
    replayed evals name the next best as they come)."""
    if not info.is_main:
        return
    name = best.record()["checkpoint"]
    checkpoints = Path(run_dir) / CHECKPOINTS
    named = best_checkpoint(run_dir)
    if name is not None and named != name and (checkpoints / name).is_dir():
        mark_best(run_dir, best.record(), keep_checkpoints)
    elif name is None and named is not None and not (checkpoints / named).is_dir():
        (checkpoints / BEST).unlink(missing_ok=True)


def mark(best: BestEval, run_dir: Path, keep_checkpoints: int, info: DistInfo) -> None:
    """RUN/checkpoints/best.json names the best eval's checkpoint (saved by now)."""
    if best.keep and info.is_main:
        mark_best(run_dir, best.record(), keep_checkpoints)


def logged_evals(path: Path, up_to: int) -> dict[int, dict[str, Any]]:
    """RUN/metrics.jsonl's eval metrics by step, steps <= ``up_to``, in step order: the
    last record of a step (a resumed run evaluates a step again after a crash)."""
    found: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line) if '"eval"' in line else {}
        if record.get("event") == "eval" and record.get("step", up_to + 1) <= up_to:
            found[record["step"]] = {k: v for k, v in record.items() if k not in ("event", "step")}
    return dict(sorted(found.items()))
