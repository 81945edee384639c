"""Training end to end through the CLI functions: learning, eval against sklearn,
resume equal to never stopping, fused equal to KV-gradient updates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from dlrm.cli import main
from dlrm.config import load_config
from dlrm.train.trainer import train
from tests.conftest import TINY, tiny_overrides
from tests.run_state import run_state


def final_state(run: Path) -> dict[str, torch.Tensor]:
    return run_state(run)


def run_train(tiny_data, run: Path, **extra) -> dict:
    cfg = load_config(
        TINY,
        tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": tiny_data["eval"], **extra}),
    )
    return train(cfg, run, echo=lambda s: None)


@pytest.mark.slow
def test_train_learns_and_eval_matches_sklearn(tiny_data, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "--config", str(TINY), "--out", str(run), *tiny_overrides(),
                 f"data.train={tiny_data['train']}", f"data.eval={tiny_data['eval']}"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["samples_per_s"] > 0
    assert summary["eval_auc"] > 0.70  # planted signal is learnt
    assert (run / "config.yaml").is_file() and (run / "schema.json").is_file()
    capsys.readouterr()

    assert main(["eval", "--checkpoint", str(run), "--data", str(tiny_data["eval"]),
                 "--plots", str(tmp_path / "plots")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 10_000
    assert result["auc"] == pytest.approx(summary["eval_auc"], abs=1e-12)
    assert all((tmp_path / "plots" / p).stat().st_size > 0 for p in ("roc.png", "calibration.png"))
    newest = str(run / "checkpoints" / f"step-{summary['steps']:09d}")
    assert f"{newest}\n{tiny_data['eval']}, 10,000 rows".encode() in (tmp_path / "plots" / "roc.png").read_bytes()

    # Independent reference: recompute predictions and hand them to sklearn.
    from data.files import expand_paths
    from dlrm.checkpoint import manager as ck
    from dlrm.checkpoint import manifest
    from dlrm.config import Config, from_dict
    from dlrm.eval.predict import predict
    from dlrm.parallel.parallelize import build_model
    from dlrm.train.inputs import make_reader

    meta = manifest.load_meta(ck.find_checkpoint(run))
    cfg = from_dict(Config, meta["config"], "")
    schema = manifest.schema_from_json(meta["schema"])
    model = build_model(cfg, schema)
    ck.load_checkpoint(ck.find_checkpoint(run), model, None, None, schema)
    scores, labels = predict(model, make_reader(cfg, expand_paths(str(tiny_data["eval"])), schema, False).epoch(0))
    assert result["auc"] == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-6)
    assert result["logloss"] == pytest.approx(log_loss(labels.numpy(), scores.numpy()), rel=1e-6)


@pytest.mark.slow
def test_resume_equals_uninterrupted(tiny_data, tmp_path: Path) -> None:
    # 40k rows / 512 = 79 steps per epoch: stop mid-epoch (30) and cross the epoch end.
    run_train(tiny_data, tmp_path / "straight", **{"train.max_steps": 100, "optim.sparse": "adam"})
    run_train(tiny_data, tmp_path / "resumed", **{"train.max_steps": 30, "optim.sparse": "adam"})
    run_train(tiny_data, tmp_path / "resumed", **{"train.max_steps": 100, "optim.sparse": "adam"})
    a, b = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_rerun_of_a_finished_run_says_nothing_was_trained(tiny_data, tmp_path: Path) -> None:
    """The same command again after the last step resumes there and trains nothing: its
    line says so (it said "trained 6 steps at 0 samples/s"), and `dlrm plot`'s run rate
    stays the run's that trained."""
    from dlrm.eval.curves import read_curves

    run, steps = tmp_path / "run", {"train.max_steps": 6, "train.log_every": 2, "data.eval": ""}
    lines: list[list[str]] = [[], []]
    summaries = []
    for said in lines:
        cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], **steps}))
        summaries.append(train(cfg, run, echo=said.append))
    first, again = summaries
    assert lines[1][-1] == "nothing trained: the run was already complete at step 6 of 6"
    assert lines[0][-1] == f"trained 6 steps at {first['samples_per_s']:,.0f} samples/s"
    assert first["samples_per_s"] > 0  # 6 steps: one after the 5 of the warm-up
    assert (first["steps"], first["trained_steps"], again["steps"], again["trained_steps"]) == (6, 6, 6, 0)
    assert read_curves(run).run_rate == first["samples_per_s"]


@pytest.mark.slow
def test_rerun_of_a_finished_run_does_not_evaluate_again(tiny_data, tmp_path: Path, monkeypatch) -> None:
    """A rerun after the last step reports the final eval that metrics.jsonl holds
    instead of scoring the eval set again (it did: a whole eval pass, a second eval line)."""
    import json

    from dlrm.train import trainer

    run = tmp_path / "run"
    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": tiny_data["eval"],
                                              "train.max_steps": 4}))
    first = train(cfg, run, echo=lambda _: None)
    evals_run: list[int] = []
    real = trainer.Trainer.run_eval
    monkeypatch.setattr(trainer.Trainer, "run_eval", lambda self: evals_run.append(1) or real(self))
    again = train(cfg, run, echo=lambda _: None)
    assert evals_run == [] and again["trained_steps"] == 0
    assert again["eval_auc"] == first["eval_auc"] and again["eval_logloss"] == first["eval_logloss"]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "eval"] == [4]
    # a run resumed short of its end still evaluates at its end
    longer = train(load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"],
                                                       "data.eval": tiny_data["eval"], "train.max_steps": 6})),
                   run, echo=lambda _: None)
    assert evals_run == [1] and longer["trained_steps"] == 2


@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.slow
def test_fused_update_equals_kv_gradient_update(tiny_data, tmp_path: Path, sparse: str) -> None:
    common = {"train.max_steps": 12, "optim.sparse": sparse, "data.eval": ""}
    run_train(tiny_data, tmp_path / "fused", **common, **{"embeddings.fused": "true"})
    run_train(tiny_data, tmp_path / "kv", **common, **{"embeddings.fused": "false"})
    a, b = final_state(tmp_path / "fused"), final_state(tmp_path / "kv")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_same_seed_same_parameters_other_seed_differs(tiny_data, tmp_path: Path) -> None:
    run_train(tiny_data, tmp_path / "a", **{"train.max_steps": 8, "data.eval": ""})
    run_train(tiny_data, tmp_path / "b", **{"train.max_steps": 8, "data.eval": ""})
    run_train(tiny_data, tmp_path / "c", **{"train.max_steps": 8, "data.eval": "", "seed": 7})
    a, b, c = (final_state(tmp_path / x) for x in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
def test_dcn_interaction_trains(tiny_data, tmp_path: Path) -> None:
    summary = run_train(
        tiny_data, tmp_path / "dcn",
        **{"model.interaction": "dcn", "model.dcn_layers": 2, "model.dcn_rank": 8, "train.max_steps": 40},
    )
    assert np.isfinite(summary["eval_logloss"]) and summary["eval_auc"] > 0.6


@pytest.mark.slow
def test_section_times_add_up_to_the_step_time(tiny_data, tmp_path: Path) -> None:
    summary = run_train(tiny_data, tmp_path / "timed", **{
        "train.max_steps": 30, "train.time_sections": "true", "data.eval": "", "embeddings.fused": "false"})
    sections = summary["sections_ms"]
    assert set(sections) == {"data_wait", "input_alltoall", "lookup", "output_alltoall", "mlp",
                             "embedding_update", "dense_update"}
    assert sections["mlp"] > 0 and sections["lookup"] > 0 and sections["embedding_update"] > 0
    step_ms = 1000 * 512 / summary["samples_per_s"]
    # Everything but Python glue between sections is accounted for.
    assert 0.7 * step_ms <= sum(sections.values()) <= 1.01 * step_ms, (sections, step_ms)
    # The summary's data-wait share is the same waits over the same steps' wall time (CPU: all exposed).
    assert abs(summary["data_wait_share"] * step_ms - sections["data_wait"]) <= 0.01 * step_ms
    assert len(summary["peak_memory_mb"]) == 1 and summary["peak_memory_mb"][0] > 10


@pytest.mark.slow
def test_profile_steps_writes_operator_table_and_trace(tiny_data, tmp_path: Path) -> None:
    run = tmp_path / "profiled"
    run_train(tiny_data, run, **{"train.max_steps": 8, "train.profile_start": 3,
                                 "train.profile_steps": 2, "data.eval": ""})
    text = (run / "profile" / "rank-0.txt").read_text()
    assert text.startswith("steps 3..4, rank 0")
    assert "page faults" in text.splitlines()[1]
    assert "aten::addmm" in text  # the MLP's operators were recorded
    trace = json.loads((run / "profile" / "rank-0.json").read_text())
    assert any(e.get("name") == "aten::embedding_bag" for e in trace["traceEvents"])
    assert not list((run / "profile").glob(".*"))  # temp names renamed away


def test_python_profile_mode_times_the_step_loops_functions(tiny_data, tmp_path: Path) -> None:
    """train.profile_mode=python: cProfile of the profiled steps' Python (Hotline's step
    loop here), by own time and by time with callees; no operator table, no trace, and
    the steps keep their mode (a captured step stays captured: only torch's mode
    forces eager, checked on the graphs' reasons)."""
    from types import SimpleNamespace

    from dlrm.train.graphs import why_not

    run = tmp_path / "python"
    run_train(tiny_data, run, **{"train.max_steps": 8, "train.profile_start": 3, "train.profile_steps": 2,
                                 "train.profile_mode": "python", "data.eval": "",
                                 "embeddings.placement": "hotline", "hotline.budget": "64KB"})
    text = (run / "profile" / "rank-0-python.txt").read_text()
    assert text.startswith("steps 3..4, rank 0, the step loop's thread under cProfile")
    assert "page faults" in text.splitlines()[1]
    by_own, by_cumulative = text.split("== by own time")[1].split("== by with callees time")
    assert "run_backward" in by_own and "hotline.py" in by_cumulative  # the Hotline step loop's
    rows = [line.split() for line in by_cumulative.splitlines()[1:] if line.strip()]
    assert [float(r[1]) for r in rows] == sorted((float(r[1]) for r in rows), reverse=True)
    assert any(r[3].endswith("(_forward_backward)") and float(r[2]) == 1.0 for r in rows)  # once a step
    assert not (run / "profile" / "rank-0.txt").exists() and not (run / "profile" / "rank-0.json").exists()
    cfg = SimpleNamespace(embeddings=SimpleNamespace(placement="sharded", backend="native", kernels="triton",
                                                     fused=True),
                          train=SimpleNamespace(accumulate=1, profile_steps=2, profile_mode="python"))
    assert why_not(cfg, torch.device("cuda"), 1) is None
    cfg.train.profile_mode = "torch"
    assert "profile_steps" in why_not(cfg, torch.device("cuda"), 1)


def test_profile_window_past_the_end_still_writes(tiny_data, tmp_path: Path) -> None:
    run = tmp_path / "short"
    run_train(tiny_data, run, **{"train.max_steps": 5, "train.profile_start": 3,
                                 "train.profile_steps": 10, "data.eval": ""})
    assert (run / "profile" / "rank-0.txt").read_text().startswith("steps 3..4, rank 0")


def test_final_checkpoint_false_saves_nothing_at_the_end(tiny_data, tmp_path: Path) -> None:
    """train.final_checkpoint=false (what dlrm bench runs): the end of the run writes no
    checkpoint, while checkpoint_every still saves on its steps; the default saves at
    the end too."""
    def saved(run: Path) -> list[str]:
        return sorted(p.name for p in (run / "checkpoints").glob("step-*")) if (run / "checkpoints").exists() else []

    steps = {"train.max_steps": 3, "data.eval": ""}
    run_train(tiny_data, tmp_path / "none", **steps, **{"train.final_checkpoint": "false"})
    run_train(tiny_data, tmp_path / "every", **steps, **{"train.final_checkpoint": "false",
                                                         "train.checkpoint_every": 2})
    run_train(tiny_data, tmp_path / "default", **steps)
    assert saved(tmp_path / "none") == []
    assert saved(tmp_path / "every") == ["step-000000002"]
    assert saved(tmp_path / "default") == ["step-000000003"]
