"""A resume reads the training files its checkpoint was trained on.

The stream of batches is a function of the files (data/reader.py): a file added to
``data.train``'s directory, one rewritten or removed, changes which rows batch t holds.
A run resumed mid-epoch over other files would train some rows of that epoch twice and
others never, silently. So each checkpoint records the files in stream order, each by
its path below the files' common directory and the sha256 of its Parquet footer
(which holds every row group's offsets and statistics: a rewritten file changes it;
one read per file), and the batches an epoch of them had. A resume compares:

    same files                  resumes as always
    other files, mid-epoch      one line naming the first difference, and the ways out
    other files, between        a note, and the next epoch starts at once over the files
    epochs                      as they are now (more days of data for the epochs still
                                to run); the epoch the checkpoint ended is not read again

Paths are relative, so a data set moved or mounted elsewhere is the same data. A
checkpoint saved before this was recorded is not checked.

The same footers say when the eval set holds training files (the same file named in
both, or a copy of one): its AUC would be measured on rows the model trained on, so
the run warns (:func:`eval_overlap`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from data.errors import UserError
from data.preprocess import footer_digest
from data.remote import is_uri


def data_identity(files: list[str], batches_per_epoch: int) -> dict[str, Any]:
    """{"files": [[path below the common directory, footer sha256], ...] in the files'
    order, "batches_per_epoch": the reader's batches in an epoch of them}."""
    keys = [urlsplit(f).path if is_uri(f) else os.path.abspath(f) for f in files]  # s3://b/k: /k
    root = os.path.commonpath([os.path.dirname(k) for k in keys]) if files else ""
    return {"files": [[os.path.relpath(k, root), footer_digest(f)] for k, f in zip(keys, files, strict=True)],
            "batches_per_epoch": batches_per_epoch}


def check_resume_data(then: dict[str, Any] | None, now: dict[str, Any], ckpt: Path,
                      step_in_epoch: int, epoch: int, say: Callable[[str], None]) -> bool:
    """Refuse (mid-epoch) or note (between epochs) training files other than the
    checkpoint's; nothing when they are the same or the checkpoint did not record them.
    ``step_in_epoch``: the checkpoint's batches into ``epoch`` (all of them: the epoch
    ended, and the next starts on the files as they are). Whether the caller must start
    the next epoch now: an ended epoch's position, its old batch count, means nothing in
    the new files' stream (more batches: their tail would be trained as the rest of the
    ended epoch; fewer: past the epoch's end)."""
    if then is None or then["files"] == now["files"]:
        return False
    change = _first_change(then["files"], now["files"])
    ended = step_in_epoch == then["batches_per_epoch"]
    if step_in_epoch == 0 or ended:
        say(f"note: data.train changed since {ckpt.name} ({change}); the run goes on at the start "
            f"of epoch {epoch + ended} over the files as they are now")
        return ended
    raise UserError(f"checkpoint {ckpt}: data.train changed since it was saved ({change}), in the "
                    f"middle of epoch {epoch}: resuming would train some of the epoch's rows twice "
                    f"and others never. Put the files back as they were, or start a new run from "
                    f"this one on the new files: --out NEW train.init_from={ckpt.parent.parent}")


def eval_overlap(train: dict[str, Any], eval_files: list[str]) -> str | None:
    """A warning when eval files are training files or copies of them (same footer)."""
    trained = {digest for _, digest in train["files"]}
    shared = [f for f in eval_files if footer_digest(f) in trained]
    if not shared:
        return None
    names = ", ".join(os.path.basename(f) for f in shared[:3]) + (", ..." if len(shared) > 3 else "")
    return (f"warning: {len(shared)} of the {len(eval_files)} eval file(s) are training files or copies "
            f"of them ({names}): the eval measures rows the model trained on; give data.eval held-out data")


def _first_change(then: list[list[str]], now: list[list[str]]) -> str:
    """The first difference between two identities, in words."""
    before: dict[str, Any] = dict(map(tuple, then))
    after: dict[str, Any] = dict(map(tuple, now))
    for name, digest in now:
        if name not in before:
            return f"{name} is new; {len(then)} file(s) then, {len(now)} now"
        if before[name] != digest:
            return f"{name} was rewritten (its Parquet footer differs)"
    for name, _ in then:
        if name not in after:
            return f"{name} is gone; {len(then)} file(s) then, {len(now)} now"
    return "the same files in another order"
