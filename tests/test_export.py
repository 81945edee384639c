"""``dlrm export``: a serving copy that ``dlrm eval`` scores.

References: the run's own eval (fp32 tables; AUC recomputed here with sklearn from the
scores), the quantiser's bound (|value - dequantised| <= scale / 2 per row) and the
bytes the format promises (dim + 8 a row).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from sklearn.metrics import roc_auc_score

from dlrm.cli import main
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.run_state import run_state


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "optim.sparse": "rowwise_adagrad",
                                               "train.max_steps": 60}))
    train(cfg, run, echo=lambda s: None)
    return run


def test_int8_export_scores_within_half_a_thousandth(trained: Path, tiny_data, tmp_path: Path, capsys) -> None:
    out = tmp_path / "serving"
    assert main(["export", "--checkpoint", str(trained), "--out", str(out), "--tables", "int8"]) == 0
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert said["step"] == 60 and said["tables"] == "int8"
    state = run_state(trained)
    weights = {k.split(".")[1]: v for k, v in state.items() if k.startswith("tables.") and k.endswith(".weight")}
    assert said["table_bytes"] == sum(w.shape[0] * (w.shape[1] + 8) for w in weights.values())
    fp32_bytes = sum(w.numel() * 4 for w in weights.values())
    assert said["table_bytes"] == pytest.approx(0.25 * fp32_bytes + 8 * sum(w.shape[0] for w in weights.values()))

    # The file holds each row's own scale and bias: dequantised values within scale / 2.
    tables = torch.load(out / "tables.pt", weights_only=True)
    for name, w in weights.items():
        q, sb = tables[name]["q"], tables[name]["scale_bias"]
        assert q.dtype == torch.uint8 and q.shape == w.shape and sb.shape == (w.shape[0], 2)
        err = (q.float() * sb[:, :1] + sb[:, 1:] - w).abs()
        assert bool((err <= sb[:, :1] / 2 + 1e-6).all()), name

    from dlrm.eval.evaluate import evaluate_checkpoint

    stored = evaluate_checkpoint(trained, str(tiny_data["eval"]), tables="int8")
    served = evaluate_checkpoint(out, str(tiny_data["eval"]))
    assert stored is not None and served is not None
    assert stored["auc"] > 0.70
    assert abs(served["auc"] - stored["auc"]) <= 0.0005, (served["auc"], stored["auc"])
    assert served["auc"] != stored["auc"]  # the int8 tables were scored, not the run's
    # the same values as the run's tables quantised in memory (dlrm eval --tables int8)
    assert (served["auc"], served["logloss"]) == (stored["int8"]["auc"], stored["int8"]["logloss"])


def test_export_auc_matches_sklearn(trained: Path, tiny_data, tmp_path: Path, monkeypatch) -> None:
    """The export's AUC is the AUC of its scores (sklearn), and a 'stored' export scores
    exactly as the run does."""
    import dlrm.eval.evaluate as ev

    seen = {}
    real = ev.evaluate

    def keep(model, reader, info):
        result, scores, labels = real(model, reader, info)
        seen["scores"], seen["labels"] = scores, labels
        return result, scores, labels

    monkeypatch.setattr(ev, "evaluate", keep)
    out = tmp_path / "stored"
    assert main(["export", "--checkpoint", str(trained), "--out", str(out), "--tables", "stored"]) == 0
    served = ev.evaluate_checkpoint(out, str(tiny_data["eval"]))
    assert served is not None
    assert served["auc"] == pytest.approx(roc_auc_score(seen["labels"].numpy(), seen["scores"].numpy()), abs=1e-12)
    stored = ev.evaluate_checkpoint(trained, str(tiny_data["eval"]))
    assert stored is not None and served["auc"] == stored["auc"]


def test_export_refusals_leave_nothing(trained: Path, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-run"
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(missing), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0] and "Traceback" not in err[0]
    assert not out.exists() and not list(tmp_path.glob(".out.tmp*"))

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert main(["export", "--checkpoint", str(trained), "--out", str(busy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(busy) in err[0]
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"]

    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["export", "--checkpoint", str(trained), "--out", str(a_file)]) == 2
    assert a_file.read_text() == "x"


def test_export_failure_midway_leaves_nothing(trained: Path, tmp_path: Path, monkeypatch) -> None:
    import dlrm.eval.export as ex

    def boom(obj, path):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "save_digested", boom)
    out = tmp_path / "serving"
    with pytest.raises(OSError):
        ex.export_run(trained, out)
    assert not out.exists() and not [p for p in tmp_path.iterdir()]


def test_altered_export_is_refused(trained: Path, tiny_data, tmp_path: Path, capsys) -> None:
    out = tmp_path / "serving"
    assert main(["export", "--checkpoint", str(trained), "--out", str(out)]) == 0
    raw = bytearray((out / "tables.pt").read_bytes())
    raw[-100] ^= 0xFF
    (out / "tables.pt").write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--data", str(tiny_data["eval"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tables.pt" in err[0]


@pytest.mark.slow
def test_stored_export_keeps_each_tables_dtype(tiny_data, tmp_path: Path) -> None:
    from dlrm.eval.evaluate import evaluate_checkpoint

    run = tmp_path / "run"
    mixed = {"embeddings.dtypes.C1": "bf16", "embeddings.dtypes.C2": "fp16"}
    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "train.max_steps": 20, **mixed}))
    train(cfg, run, echo=lambda s: None)
    out = tmp_path / "serving"
    assert main(["export", "--checkpoint", str(run), "--out", str(out), "--tables", "stored"]) == 0
    tables = torch.load(out / "tables.pt", weights_only=True)
    assert tables["C1"]["weight"].dtype == torch.bfloat16 and tables["C2"]["weight"].dtype == torch.float16
    assert tables["C3"]["weight"].dtype == torch.float32
    served, stored = (evaluate_checkpoint(p, str(tiny_data["eval"])) for p in (out, run))
    assert served is not None and stored is not None and served["auc"] == stored["auc"]


def test_a_vocabulary_run_and_its_export_score_after_a_move(tiny_data, tmp_path: Path) -> None:
    """A run directory copied elsewhere (the original removed) and an export of it moved
    again each score as the run's own end-of-run eval. The export copied a
    ``vocabularies/`` directory that no run has (its vocabularies are in
    ``preprocessing/``): every export of a vocabulary-encoded run was refused at its eval
    (``preprocessing/vocab-0.parquet: missing or altered``)."""
    from dlrm.eval.evaluate import evaluate_checkpoint

    first = tmp_path / "machine-a" / "run"
    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": tiny_data["eval"],
                                              "data.encoding": "vocabulary", "train.max_steps": 10}))
    summary = train(cfg, first, echo=lambda s: None)
    assert (first / "preprocessing" / "vocab-0.parquet").is_file()
    run = shutil.copytree(first, tmp_path / "machine-b" / "run")
    shutil.rmtree(tmp_path / "machine-a")
    export = tmp_path / "machine-b" / "serving"
    assert main(["export", "--checkpoint", str(run), "--out", str(export), "--tables", "stored"]) == 0
    moved = shutil.move(export, tmp_path / "serving")
    results = [evaluate_checkpoint(run, str(tiny_data["eval"]))]
    shutil.rmtree(tmp_path / "machine-b")  # the export stands alone
    results.append(evaluate_checkpoint(moved, str(tiny_data["eval"])))
    for result in results:
        assert result is not None and result["rows"] == summary["eval_rows"]
        assert result["auc"] == pytest.approx(summary["eval_auc"], abs=1e-6)
        assert result["logloss"] == pytest.approx(summary["eval_logloss"], abs=1e-6)
