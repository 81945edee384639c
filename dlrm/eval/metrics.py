"""Offline metrics over predicted probabilities and 0/1 labels: AUC, log loss, NE, calibration.

Every function takes ``scores`` [N] (probabilities in [0, 1]) and ``labels`` [N] (0/1),
as numpy arrays or CPU torch tensors, and accumulates in float64. All are exact (no
binning, no sampling); AUC is O(N log N) (one sort) and fine for 10M rows.

    NE          = logloss / H(ctr),  H(p) = -(p log p + (1-p) log(1-p))   (He et al. 2014)
    calibration = mean(score) / ctr   (1 = calibrated, > 1 = over-predicts clicks)

Errors a caller can cause (one class only, mismatched lengths, NaN scores) are
:class:`ValueError` with a one-line message; the CLI turns it into an exit code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

EPS = 1e-7  # probabilities are clipped to [EPS, 1 - EPS] before any log


class NotFinite(ValueError):
    """Scores or labels holding NaN or infinite values; ``name`` says which."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name}: contains NaN or infinite values")
        self.name = name


def _as_numpy(x: Any, name: str) -> np.ndarray:
    """Flatten a numpy array, torch tensor (any device) or sequence to a 1-D float64 array."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().to("cpu").double().numpy()
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(arr)):
        raise NotFinite(name)
    return arr


def _inputs(scores: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    s, y = _as_numpy(scores, "scores"), _as_numpy(labels, "labels")
    if s.shape != y.shape:
        raise ValueError(f"scores has {s.size} rows but labels has {y.size}")
    if s.size == 0:
        raise ValueError("no rows to evaluate")
    return s, y


def _binary(y: np.ndarray) -> np.ndarray:
    """Labels as bool [N]; raises unless every label is 0 or 1 and both classes occur."""
    pos = y == 1
    if not np.all(pos | (y == 0)):
        raise ValueError("labels must be 0 or 1 for AUC")
    n_pos = int(pos.sum())
    if n_pos == 0 or n_pos == y.size:
        raise ValueError(
            f"AUC is undefined: only one class present (all {y.size} labels are {int(y[0])})"
        )
    return pos


def _roc_counts(s: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cumulative (false positives, true positives) at each distinct threshold, high → low.

    Returns fps [T+1], tps [T+1] (int64, starting at 0) and thresholds [T]: predicting
    "click" for score >= thresholds[t] gives fps[t+1] false and tps[t+1] true positives.
    Tied scores share one threshold, so a tie contributes a diagonal (trapezoid) step.
    """
    order = np.argsort(-s, kind="stable")
    s_sorted = s[order]
    tp_cum = np.cumsum(pos[order], dtype=np.int64)
    # the last index of each run of equal scores
    last = np.flatnonzero(np.diff(s_sorted) != 0)
    last = np.append(last, s.size - 1)
    tps = np.concatenate(([0], tp_cum[last]))
    fps = np.concatenate(([0], last + 1 - tp_cum[last]))
    return fps, tps, s_sorted[last]


def auc(scores: Any, labels: Any) -> float:
    """Exact ROC AUC (equals sklearn's roc_auc_score, ties counted as half).

    Trapezoid over the distinct thresholds, summed in int64 (exact up to ~3e9 rows)
    and divided once: 2·area = Σ (fp_i − fp_{i−1})·(tp_i + tp_{i−1}).
    """
    s, y = _inputs(scores, labels)
    pos = _binary(y)
    fps, tps, _ = _roc_counts(s, pos)
    twice_area = np.sum(np.diff(fps) * (tps[1:] + tps[:-1]))
    return float(twice_area / (2.0 * float(tps[-1]) * float(fps[-1])))


def roc_curve_points(
    scores: Any, labels: Any, max_points: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROC curve as (fpr [T+1], tpr [T+1], thresholds [T+1]), starting at (0, 0).

    ``thresholds[0]`` is +inf (nothing predicted positive). With ``max_points`` the
    curve is thinned to at most that many evenly spaced points, keeping both ends
    (for plotting; the AUC is always computed from all points).
    """
    s, y = _inputs(scores, labels)
    fps, tps, thr = _roc_counts(s, _binary(y))
    fpr = fps / float(fps[-1])
    tpr = tps / float(tps[-1])
    thresholds = np.concatenate(([np.inf], thr))
    if max_points is not None and fpr.size > max_points:
        keep = np.unique(np.linspace(0, fpr.size - 1, max(max_points, 2)).round().astype(np.int64))
        fpr, tpr, thresholds = fpr[keep], tpr[keep], thresholds[keep]
    return fpr, tpr, thresholds


def logloss(scores: Any, labels: Any) -> float:
    """Mean binary cross-entropy, probabilities clipped to [1e-7, 1 - 1e-7]."""
    s, y = _inputs(scores, labels)
    p = np.clip(s, EPS, 1.0 - EPS)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def _entropy(ctr: float) -> float:
    p = min(max(ctr, EPS), 1.0 - EPS)
    return float(-(p * np.log(p) + (1.0 - p) * np.log1p(-p)))


def normalized_entropy(scores: Any, labels: Any) -> float:
    """Log loss divided by the entropy of the empirical CTR (1 = no better than the CTR)."""
    s, y = _inputs(scores, labels)
    ctr = float(y.mean())
    if ctr <= 0.0 or ctr >= 1.0:
        raise ValueError(f"NE is undefined: the empirical CTR is {ctr:g} (one class only)")
    return logloss(s, y) / _entropy(ctr)


def calibration(scores: Any, labels: Any) -> float:
    """Mean prediction divided by the empirical CTR (1 = calibrated on average)."""
    s, y = _inputs(scores, labels)
    ctr = float(y.mean())
    if ctr <= 0.0:
        raise ValueError("calibration is undefined: no positive labels")
    return float(s.mean() / ctr)


def calibration_curve(
    scores: Any, labels: Any, n_bins: int = 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reliability curve over equal-count bins of the sorted scores.

    Returns (mean prediction [K], observed positive rate [K], rows [K]) with
    K = min(n_bins, N); a perfectly calibrated model lies on the diagonal.
    """
    s, y = _inputs(scores, labels)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    order = np.argsort(s, kind="stable")
    k = min(n_bins, s.size)
    starts = np.linspace(0, s.size, k + 1).round().astype(np.int64)[:-1]
    starts = np.unique(starts)
    counts = np.diff(np.append(starts, s.size))
    mean_pred = np.add.reduceat(s[order], starts) / counts
    observed = np.add.reduceat(y[order], starts) / counts
    return mean_pred, observed, counts


def evaluate_predictions(scores: Any, labels: Any) -> dict[str, float | int]:
    """All metrics at once: {"auc", "logloss", "ne", "calibration", "ctr", "rows"}."""
    s, y = _inputs(scores, labels)
    area = auc(s, y)  # raises first if only one class is present
    ctr = float(y.mean())
    ll = logloss(s, y)
    return {
        "auc": area,
        "logloss": ll,
        "ne": ll / _entropy(ctr),
        "calibration": float(s.mean() / ctr),
        "ctr": ctr,
        "rows": int(s.size),
    }
