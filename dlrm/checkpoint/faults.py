"""Fault injection for the crash tests: a process kills itself at a chosen point.

    DLRM_FAULT=ACTION:STEP:RANK     e.g. DLRM_FAULT=kill_after_shards:12:1

ACTION is one of

    kill_after_shards    SIGKILL in the save of step STEP, once this rank's embedding
                         shards are on disk (rank 0 has not yet written state.pt,
                         meta.json or renamed the checkpoint into place)
    kill_before_rename   SIGKILL in the save of step STEP with every file written,
                         meta.json included, just before rank 0 renames the
                         checkpoint into place (meaningful for RANK 0)

It fires in the first incarnation of a torchrun job only (TORCHELASTIC_RESTART_COUNT
unset or 0), so the restarted job runs through. This is a test hook, not
configuration: it is read from the environment so that a test can aim it at one
rank of a real ``torchrun`` job without a config key nobody else should set.
"""

from __future__ import annotations

import os
import signal

ACTIONS = ("kill_after_shards", "kill_before_rename")


def inject(action: str, step: int, rank: int) -> None:
    """SIGKILL this process if DLRM_FAULT names ``action`` at ``step`` on ``rank``."""
    spec = os.environ.get("DLRM_FAULT", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    name, _, rest = spec.partition(":")
    at_step, _, at_rank = rest.partition(":")
    if name not in ACTIONS:
        raise ValueError(f"DLRM_FAULT={spec!r}: action must be one of {', '.join(ACTIONS)}")
    if name == action and int(at_step) == step and int(at_rank or 0) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
