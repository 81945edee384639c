"""Evaluation plots: ROC curve and reliability (calibration) diagram, as PNG files.

matplotlib is imported inside :func:`write_plots` (it takes ~0.3 s) and drawn with
the Agg canvas directly, so no global backend or pyplot state is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic import atomic_path
from dlrm.eval.metrics import auc, calibration_curve, roc_curve_points

ROC_FILE = "roc.png"
CALIBRATION_FILE = "calibration.png"


def write_plots(scores: Any, labels: Any, out_dir: str | Path, n_bins: int = 20,
                caption: str = "") -> list[str]:
    """Write ``roc.png`` and ``calibration.png`` into ``out_dir``; return their paths.

    scores [N] probabilities, labels [N] 0/1 (numpy or torch). ``caption`` (what was
    scored on what: ``dlrm eval`` gives checkpoint, data and rows) is printed under
    each plot and stored as the PNG's Description, so two runs' plots side by side say
    which is which. Each file is written under a temporary name and renamed, so a
    reader never sees half a PNG.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    area = auc(scores, labels)
    fpr, tpr, _ = roc_curve_points(scores, labels, max_points=2000)
    mean_pred, observed, _ = calibration_curve(scores, labels, n_bins=n_bins)

    roc = Figure(figsize=(5, 5), dpi=100)
    FigureCanvasAgg(roc)
    ax = roc.add_subplot()
    ax.plot(fpr, tpr, lw=1.5, label="model")
    ax.plot([0, 1], [0, 1], ls="--", c="grey", lw=1, label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", xlim=(0, 1), ylim=(0, 1))
    ax.set_title(f"ROC (AUC = {area:.4f})")
    ax.legend(loc="lower right")

    cal = Figure(figsize=(5, 5), dpi=100)
    FigureCanvasAgg(cal)
    ax = cal.add_subplot()
    hi = float(max(mean_pred.max(), observed.max(), 1e-6)) * 1.05
    ax.plot([0, hi], [0, hi], ls="--", c="grey", lw=1, label="perfectly calibrated")
    ax.plot(mean_pred, observed, marker="o", lw=1.5, label=f"model ({len(mean_pred)} bins)")
    ax.set(xlabel="mean prediction", ylabel="observed click rate", xlim=(0, hi), ylim=(0, hi))
    ax.set_title("Calibration (equal-count bins)")
    ax.legend(loc="upper left")

    paths = []
    for fig, name in ((roc, ROC_FILE), (cal, CALIBRATION_FILE)):
        if caption:
            fig.subplots_adjust(bottom=0.16)
            fig.text(0.5, 0.01, _fit(caption), ha="center", va="bottom", fontsize=7, color="dimgrey")
        final = out / name
        with atomic_path(final) as tmp:
            fig.savefig(tmp, format="png", metadata={"Description": caption} if caption else None)
        paths.append(str(final))
    return paths


def _fit(caption: str, width: int = 90) -> str:
    """The caption on at most two lines of ``width`` characters, a long path's start
    elided (its end names the run and step)."""
    lines = []
    for part in caption.split("\n")[:2]:
        lines.append(part if len(part) <= width else "..." + part[-(width - 3):])
    return "\n".join(lines)
