"""Training: the ``Trainer`` and its step, the input readers of a run, LR schedules,
the Hotline micro-batch driver, and what a long run writes beside it (logs, traces,
profiles, the bad-data report)."""
