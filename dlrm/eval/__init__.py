"""Offline evaluation: predictions over a reader, exact metrics (AUC, log loss, NE,
calibration), plots, and ``dlrm eval`` on a checkpoint."""
