"""RUN/bad_data.jsonl under ``data.on_error=skip``: what every rank dropped, in one file.

    rank r:  reader.bad_data ──JSON lines──► all_gather (bytes) ──► every rank: the records
             of all ranks, plus those of the file an earlier incarnation of this run wrote
    rank 0:  writes them, de-duplicated, by temp name + rename

One line per record (see data/bad_data.py), with ``"split": "train"`` or ``"eval"``.
Written at every checkpoint and at the end: after a crash the resumed run reads again
every batch after its checkpoint, and finds the records of those, so none is lost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.atomic import write_atomic
from data.bad_data import BadRecord, count
from data.errors import DataError
from dlrm.parallel.distributed import DistInfo, all_gather_rows

FILE = "bad_data.jsonl"


class BadDataReport:
    """Gathers the readers' records into ``RUN/bad_data.jsonl``; counts the rows this
    process's steps really trained, over all ranks (``rows_trained``, added by the
    training loop; since the start or resume of this incarnation)."""

    def __init__(self, run_dir: Path, info: DistInfo, readers: dict[str, Any],
                 resumed: bool) -> None:
        self.path = run_dir / FILE
        self.info, self.readers = info, readers
        self.rows_trained = 0
        self._earlier: list[str] = []  # lines of an earlier incarnation of this run
        if resumed and self.path.exists():
            self._earlier = [x for x in self.path.read_text().splitlines() if x.strip()]
        _check_same_layout(readers["train"], info)

    def write(self) -> dict[str, Any]:
        """Gather every rank's records, write the file (rank 0); the counts per split.

        A collective: every rank calls it at the same point."""
        lines = list(dict.fromkeys(self._earlier + gather_lines(self.readers, self.info)))
        if self.info.is_main:
            write_atomic(self.path, "".join(x + "\n" for x in lines))
        by_split = {split: [] for split in self.readers} | records_by_split(lines)
        out: dict[str, Any] = dict(count(by_split.pop("train", [])),
                                   rows_trained=self.rows_trained)
        for split, records in by_split.items():
            out.update({f"{split}_{k}": v for k, v in count(records).items()})
        out["records"] = str(self.path)
        return out

    def line(self, counts: dict[str, Any]) -> str:
        """One line for the end of a run."""
        text = f"skipped {counts['rows']} bad rows in {counts['row_groups']} row groups"
        if counts["files"]:
            text += f" and {counts['files']} whole files"
        if counts.get("eval_rows") or counts.get("eval_files"):
            text += (f" (eval: {counts['eval_rows']} rows, {counts['eval_row_groups']} row "
                     f"groups, {counts['eval_files']} files)")
        return f"{text}; see {self.path}"


def gather_lines(readers: dict[str, Any], info: DistInfo) -> list[str]:
    """Every rank's records as JSON lines with their split, in rank order (a collective)."""
    mine = "".join(
        json.dumps({"split": split, **rec.to_json()}, sort_keys=True) + "\n"
        for split, reader in readers.items() for rec in reader.bad_data.records
    )
    data = np.frombuffer(mine.encode(), dtype=np.uint8).copy()
    return bytes(all_gather_rows(torch.from_numpy(data), info).numpy()).decode().splitlines()


def records_by_split(lines: list[str]) -> dict[str, list[BadRecord]]:
    out: dict[str, list[BadRecord]] = {}
    for line in lines:
        d = json.loads(line)
        out.setdefault(d.pop("split"), []).append(BadRecord.from_json(d))
    return out


def _check_same_layout(reader: Any, info: DistInfo) -> None:
    """Refuse ranks whose readers disagree on the files' rows (a file that went bad
    while the ranks started): their data orders would not fit together."""
    if info.world_size == 1:
        return
    mine = torch.tensor([reader.num_rows, reader.steps_per_epoch()], dtype=torch.int64)
    every = all_gather_rows(mine, info).view(info.world_size, 2)
    if not bool((every == every[0]).all()):
        raise DataError(
            "ranks see different training data (rows, steps per rank: "
            f"{every.tolist()}): a file changed or vanished while the job started"
        )
