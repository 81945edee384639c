"""dlrm.eval.metrics against sklearn, and dlrm.eval.plots writing real PNGs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score, roc_curve

from dlrm.eval import metrics
from dlrm.eval.plots import write_plots


def _data(n: int, ctr: float, seed: int, signal: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Labels with rate ~ctr and scores in (0, 1) that carry some signal about them."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < ctr).astype(np.float32)
    logit = np.log(ctr / (1 - ctr)) + signal * (y - ctr) + rng.normal(size=n)
    return (1.0 / (1.0 + np.exp(-logit))).astype(np.float32), y


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ctr", [0.5, 0.03])
def test_auc_and_logloss_match_sklearn(seed: int, ctr: float) -> None:
    s, y = _data(5000, ctr, seed)
    assert metrics.auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-9)
    assert metrics.logloss(s, y) == pytest.approx(log_loss(y, s), rel=1e-6)


@pytest.mark.parametrize("decimals", [0, 1, 2])
def test_auc_heavy_ties(decimals: int) -> None:
    s, y = _data(20000, 0.2, seed=3, signal=2.0)
    s = np.round(s, decimals)  # decimals=0: only the values 0 and 1
    assert np.unique(s).size <= 10**decimals + 1
    assert metrics.auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-9)


def test_auc_all_tied_is_half_and_reversed_is_complement() -> None:
    s, y = _data(1000, 0.3, seed=4)
    assert metrics.auc(np.full_like(s, 0.25), y) == pytest.approx(0.5, abs=1e-12)
    assert metrics.auc(1 - s, y) == pytest.approx(1 - metrics.auc(s, y), abs=1e-12)
    perfect = metrics.auc(y * 0.5 + 0.25, y)
    assert perfect == 1.0


def test_imbalanced_tiny_positive_rate() -> None:
    s, y = _data(50000, 0.001, seed=5, signal=3.0)
    assert 0 < y.sum() < 200
    assert metrics.auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-9)
    assert metrics.logloss(s, y) == pytest.approx(log_loss(y, s), rel=1e-6)


def test_one_million_rows_with_ties_and_torch_inputs() -> None:
    s, y = _data(1_000_000, 0.1, seed=6)
    s = np.round(s, 3)
    expect = roc_auc_score(y, s)
    assert metrics.auc(s, y) == pytest.approx(expect, abs=1e-6)
    assert metrics.auc(torch.from_numpy(s), torch.from_numpy(y)) == pytest.approx(expect, abs=1e-6)
    out = metrics.evaluate_predictions(torch.from_numpy(s), torch.from_numpy(y).bool())
    assert out["rows"] == 1_000_000 and isinstance(out["rows"], int)
    assert out["auc"] == pytest.approx(expect, abs=1e-6)
    assert out["ctr"] == pytest.approx(float(y.mean()))
    assert out["logloss"] == pytest.approx(log_loss(y, np.clip(s, 1e-7, 1 - 1e-7)), rel=1e-6)


def test_roc_curve_points_match_sklearn() -> None:
    s, y = _data(3000, 0.4, seed=7)
    s = np.round(s, 2)
    fpr, tpr, thr = metrics.roc_curve_points(s, y)
    sk_fpr, sk_tpr, sk_thr = roc_curve(y, s, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr)
    np.testing.assert_allclose(tpr, sk_tpr)
    np.testing.assert_allclose(thr[1:], sk_thr[1:])
    assert np.trapezoid(tpr, fpr) == pytest.approx(metrics.auc(s, y), abs=1e-12)
    fpr2, tpr2, _ = metrics.roc_curve_points(s, y, max_points=10)
    assert len(fpr2) <= 10 and (fpr2[0], tpr2[0], fpr2[-1], tpr2[-1]) == (0, 0, 1, 1)


def test_ne_of_constant_ctr_predictor_is_one_and_better_model_below_one() -> None:
    s, y = _data(20000, 0.1, seed=8, signal=3.0)
    ctr = float(y.mean())
    assert metrics.normalized_entropy(np.full_like(s, ctr), y) == pytest.approx(1.0, abs=1e-6)
    out = metrics.evaluate_predictions(np.full_like(s, ctr), y)
    assert out["ne"] == pytest.approx(1.0, abs=1e-6)
    assert out["calibration"] == pytest.approx(1.0, rel=1e-6)
    assert out["auc"] == pytest.approx(0.5)
    # a model with signal beats the CTR; NE uses the entropy in nats like logloss
    ne = metrics.normalized_entropy(s, y)
    h = -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    assert ne == pytest.approx(log_loss(y, s) / h, rel=1e-6)


def test_calibration_of_calibrated_and_miscalibrated_predictors() -> None:
    rng = np.random.default_rng(9)
    p = rng.beta(1, 8, size=400_000)
    y = (rng.random(p.size) < p).astype(np.float64)  # labels drawn from p: calibrated
    assert metrics.calibration(p, y) == pytest.approx(1.0, abs=0.02)
    assert metrics.calibration(p * 2, y) == pytest.approx(2.0, abs=0.04)
    mean_pred, observed, counts = metrics.calibration_curve(p, y, n_bins=10)
    assert counts.sum() == p.size and counts.max() - counts.min() <= 1
    assert np.all(np.diff(mean_pred) > 0)
    np.testing.assert_allclose(observed, mean_pred, atol=0.01)
    # over-prediction shows as points below the diagonal
    mp2, obs2, _ = metrics.calibration_curve(p * 2, y, n_bins=10)
    assert np.all(obs2 < mp2)


def test_calibration_curve_more_bins_than_rows() -> None:
    mean_pred, observed, counts = metrics.calibration_curve([0.1, 0.9, 0.5], [0, 1, 1], n_bins=10)
    np.testing.assert_allclose(mean_pred, [0.1, 0.5, 0.9])
    np.testing.assert_allclose(observed, [0, 1, 1])
    assert counts.tolist() == [1, 1, 1]


def test_clipping_keeps_logloss_finite() -> None:
    y = np.array([1.0, 0.0, 1.0, 0.0])
    s = np.array([0.0, 1.0, 1.0, 0.0])
    expect = -np.log(1e-7) / 2  # two certain mistakes at the clip value, two near-zero losses
    assert metrics.logloss(s, y) == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize(
    ("scores", "labels", "match"),
    [
        ([0.1, 0.2], [1, 1], "only one class"),
        ([0.1, 0.2], [0, 0], "only one class"),
        ([0.1, 0.2, 0.3], [0, 1], "rows"),
        ([0.1, float("nan")], [0, 1], "NaN"),
        ([0.1, 0.2], [0, 0.5], "0 or 1"),
        ([], [], "no rows"),
    ],
)
def test_user_errors_are_value_errors(scores: list, labels: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        metrics.evaluate_predictions(np.array(scores), np.array(labels))


def test_metrics_import_is_light() -> None:
    code = (
        "import sys, dlrm.eval.metrics; "
        "print(any(m.startswith(('torch', 'matplotlib')) for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_write_plots_makes_pngs(tmp_path) -> None:
    s, y = _data(200_000, 0.1, seed=10)
    paths = write_plots(torch.from_numpy(s), torch.from_numpy(y), tmp_path / "plots")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["roc.png", "calibration.png"]
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert sorted(f.name for f in (tmp_path / "plots").iterdir()) == ["calibration.png", "roc.png"]
    # a caption (dlrm eval's: checkpoint, data, rows) is drawn and kept as the PNG's Description
    caption = "runs/a/checkpoints/step-000000007\ndata/day_23, 200,000 rows"
    captioned = write_plots(s, y, tmp_path / "captioned", caption=caption)
    for plain, marked in zip(paths, captioned, strict=True):
        data = Path(marked).read_bytes()
        assert b"Description\x00" + caption.encode("latin-1") in data
        assert b"Description" not in Path(plain).read_bytes() and data != Path(plain).read_bytes()
