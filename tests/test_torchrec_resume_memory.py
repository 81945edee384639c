"""The TorchRec backend's resume and save hold one copy of the tables, not two.

Its state.pt holds the whole tables. Loaded into memory (as before), they were a
second copy beside the model's until the load ended; now state.pt is mapped and
each table's pages are given back once it is copied into the model, so the peak
RSS of the resume (VmHWM, in a fresh process) exceeds the RSS of the built model by
about one table, not by all of them. The tables' float64 sum after the resume
equals the saved one (the reference: the model that saved them).

    4 tables x 50000 rows x 64 float32 = 51 MB; one table 12.8 MB
    before this change: +51 MB expected (all four tables); measured on main dc1fb84
    with 4 x 200000 rows: +205 MB anonymous memory during the load

The save (``export_state``) gives a table held whole on the CPU as a view of the live
weights: it once copied every table into a zeroed tensor first (+1x; a 14 GB table
on a 24 GiB machine was OOM-killed at its first checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchrec")

from dlrm.bench.checkpoint import in_fresh_process, peak_rss, rss_bytes

MODEL = ["generate.sparse=4", "generate.table_rows=[50000]", "optim.sparse=sgd", "embeddings.backend=torchrec"]
TABLES = 4 * 50000 * 64 * 4


def _save(run: str) -> float:
    from dlrm.bench.checkpoint import _model
    from dlrm.checkpoint.manager import Progress, save_checkpoint
    from dlrm.config import to_dict

    cfg, schema, model, opt = _model("configs/bench.yaml", MODEL, resume=False)
    save_checkpoint(Path(run), model, opt, Progress(global_step=1), to_dict(cfg), schema)
    return sum(float(t.double().sum()) for t in model.embedding_weights().values())


def _resume(run: str) -> dict:
    import torch

    from dlrm.bench.checkpoint import _model
    from dlrm.checkpoint.manager import resume_checkpoint
    from dlrm.config import to_dict

    torch.set_num_threads(1)
    cfg, schema, model, opt = _model("configs/bench.yaml", MODEL, resume=True)
    built = rss_bytes()
    with peak_rss() as peak:
        found = resume_checkpoint(Path(run), model, opt, to_dict(cfg), schema, warn=print)
    return {"step": found[1].global_step, "built": built, "peak": peak(),
            "sum": sum(float(t.double().sum()) for t in model.embedding_weights().values())}


@pytest.mark.slow
def test_torchrec_resume_holds_one_copy_of_the_tables(tmp_path: Path) -> None:
    saved_sum = in_fresh_process(_save, str(tmp_path))
    r = in_fresh_process(_resume, str(tmp_path))
    assert r["step"] == 1 and r["sum"] == saved_sum
    over = r["peak"] - r["built"]
    # One table (12.8 MB) beside the model plus buffers; two copies would be +51 MB.
    assert over <= TABLES // 2, f"resume: +{over / 2**20:.1f} MiB over the built model"


def _save_peak(run: str) -> dict:
    from dlrm.bench.checkpoint import _model
    from dlrm.checkpoint.manager import Progress, save_checkpoint
    from dlrm.config import to_dict

    cfg, schema, model, opt = _model("configs/bench.yaml", MODEL, resume=False)
    built = rss_bytes()
    with peak_rss() as peak:
        save_checkpoint(Path(run), model, opt, Progress(global_step=1), to_dict(cfg), schema)
    return {"built": built, "peak": peak()}


@pytest.mark.slow
def test_torchrec_save_holds_one_copy_of_the_tables(tmp_path: Path) -> None:
    r = in_fresh_process(_save_peak, str(tmp_path))
    over = r["peak"] - r["built"]
    assert over <= TABLES // 2, f"save: +{over / 2**20:.1f} MiB over the built model"
    assert (tmp_path / "checkpoints").is_dir()
