"""``dlrm fit``: a run's preprocessing fitted once, saved for any later run to reuse.

    dlrm fit --config F --data PATH --out DIR ──► DIR/preprocessing.json + DIR/preprocessing/
    dlrm train ... data.preprocessing=DIR      ──► no pass: DIR's vocabularies, checked by
                                                   the data files' footer sha256

The fit is exactly the one ``dlrm train`` runs (dlrm/train/inputs.py resolve_data over
the same config and files) and is saved by the same writer, so a run that reuses it
trains the same parameters as one that fits for itself. Under torchrun
(``torchrun --nproc_per_node=N -m dlrm fit ...``, any number of machines) each rank
counts 1/W of the row groups and the counts merge (data/fit_split.py), over gloo.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from data import preprocess as prep_io
from dlrm.config import Config
from dlrm.train.inputs import resolve_data


def fit_and_save(cfg: Config, data: str, out: str | Path, write: bool = True) -> list[str]:
    """Fit the preprocessing of ``cfg`` over ``data`` (data.train), write it to ``out``
    (``write``: under torchrun, rank 0 writes; every rank fits the same); the lines to
    print."""
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train=data, eval="",
                                                            preprocessing=""))
    run = resolve_data(cfg)
    out = Path(out)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        prep_io.save(run.preprocess, out)
    encodings = ", ".join(f"{t} {e}" for t, e in sorted(run.preprocess.encodings.items()))
    return [*run.preprocess.notes, f"encodings: {encodings}",
            (f"wrote {out / prep_io.FILE} over {len(run.preprocess.data)} data files: "
             f"train with data.preprocessing={out}")]
