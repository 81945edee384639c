"""What a benchmark ran on, stated beside its figures: the commit of the code (and
whether the tree had changes not committed), the device, the torch build. Figures of
two sessions compare only with these beside them.

    provenance()  {"commit": "3f51fbc", "tree": "clean", "device": "cpu, 2 cores",
                   "torch": "2.13.0+cpu"}
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    """A git command's output in this package's checkout; None where there is no git or
    no checkout (an installed copy)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def provenance() -> dict[str, Any]:
    import torch

    commit = _git("rev-parse", "--short", "HEAD")
    changes = _git("status", "--porcelain", "--untracked-files=no")
    if commit is None and os.environ.get("DLRM_COMMIT"):  # a copy of the tree without .git (the
        commit, changes = os.environ["DLRM_COMMIT"], None   # lent GPU machine): told by the caller
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        device = f"cpu, {os.cpu_count()} cores"
    return {"commit": commit or "unknown (not a git checkout; set DLRM_COMMIT)",
            "tree": "unknown" if changes is None else "clean" if not changes else "uncommitted changes",
            "device": device, "torch": torch.__version__}


def provenance_line(p: dict[str, Any]) -> str:
    tree = "" if p["tree"] == "clean" else f" ({p['tree']})"
    return f"commit {p['commit']}{tree}; {p['device']}; torch {p['torch']}"
