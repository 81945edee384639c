"""train.cuda_graphs on the CPU: where no graph can run, auto trains eager and says
why, on refuses in one line (tests/test_gpu.py: on CUDA a replayed run equals an eager one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlrm.cli import main
from dlrm.config import load_config
from dlrm.train.graphs import why_not
from tests.conftest import TINY, tiny_overrides


def test_why_not_names_the_first_obstacle() -> None:
    cfg = load_config(TINY, ["embeddings.kernels=triton", "optim.dense=sgd"])
    assert why_not(cfg, torch.device("cpu"), 1) == "no CUDA device"
    assert why_not(cfg, torch.device("cuda"), 2).startswith("more than one process")
    assert why_not(cfg, torch.device("cuda"), 1) is None
    hot = load_config(TINY, ["embeddings.placement=hotline"])
    assert why_not(hot, torch.device("cuda"), 1).startswith("placement=hotline")
    # dense adagrad: captured where torch fuses it on CUDA (tests/test_dense_optimizer.py)
    assert why_not(load_config(TINY, ["train.accumulate=2", "optim.dense=sgd"]), torch.device("cuda"), 1) \
        == "unfused sparse updates"


def test_half_tables_and_state_are_capturable() -> None:
    """Tables of several dtypes (one process: DtypeStacks, routed on the device) and
    half optimizer state (the fused Triton update rounds it) pass; their kernels' step
    has no host sync (tests/test_dtype_stacks.py); tests/test_gpu.py replays them."""
    base = ["embeddings.kernels=triton", "optim.dense=sgd"]
    mixed = load_config(TINY, [*base, "embeddings.dtypes.C1=fp32", "embeddings.dtypes.C2=fp16",
                               "embeddings.dtype=bf16"])
    state = load_config(TINY, [*base, "optim.sparse=adam", "embeddings.state_dtype=bf16"])
    for cfg in (mixed, state):
        assert why_not(cfg, torch.device("cuda"), 1) is None
        assert why_not(cfg, torch.device("cuda"), 2).startswith("more than one process")
    torch_kernels = load_config(TINY, ["embeddings.kernels=torch", "optim.dense=sgd", "embeddings.dtypes.C1=bf16"])
    assert why_not(torch_kernels, torch.device("cuda"), 1).startswith("embeddings.kernels=torch")
    for dtypes in (["embeddings.dtype=bf16"], ["embeddings.dtypes.C1=bf16"]):  # one dtype; per-table dtypes
        hotline = load_config(TINY, [*base, *dtypes, "embeddings.placement=hotline"])
        assert why_not(hotline, torch.device("cuda"), 1).startswith("placement=hotline")


def test_auto_on_cpu_trains_eager_and_says_so(tiny_data, tmp_path: Path, capsys) -> None:
    import json

    argv = ["train", "--config", str(TINY), "--out", str(tmp_path / "run"),
            *tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": ""}), "train.max_steps=2",
            "train.device=cpu"]
    assert main(argv) == 0
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert events[-1]["step_mode"] == "eager (no CUDA device)"
    capsys.readouterr()
    assert main([*argv[:4], str(tmp_path / "run2"), *argv[5:], "train.cuda_graphs=on"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.cuda_graphs=on" in err and "no CUDA device" in err


def _skip_data(root: Path) -> Path:
    """8 batches of 32 single-hot rows, the 4th (step 3, the capture's) with a NaN
    dense value: under data.on_error=skip that row is dropped, the batch short."""
    import numpy as np

    from tests.data_helpers import write_parquet

    rng = np.random.default_rng(0)
    n = 256
    dense = rng.random(n).astype(np.float32)
    dense[3 * 32 + 5] = np.nan
    (root / "train").mkdir(parents=True)
    write_parquet(root / "train" / "part.parquet", {
        "label": rng.integers(0, 2, n).astype(np.float32), "I1": dense, "I2": rng.random(n).astype(np.float32),
        "C1": rng.integers(0, 50, n), "C2": rng.integers(0, 50, n)}, row_group_size=64)
    return root / "train"


def test_a_skip_run_captures_on_a_full_batch_and_trains_as_eager(tmp_path: Path, monkeypatch) -> None:
    """data.on_error=skip no longer keeps the step eager: a batch that lost rows has
    another shape and runs eager, as an epoch's short last batch does. The capture
    waits for a full batch: step 3, the first a capture may take, is short here, so the
    graph is captured at step 4 (captured at 3 it would have the short shape, and every
    full batch after it would run eager). Stand-in graphs (a replay runs the captured
    body eagerly, as tests/test_dense_graphs.py's); reference: the same run eager, bit
    for bit."""
    from dlrm.train import graphs as graphs_module
    from dlrm.train import trainer as trainer_module
    from dlrm.train.trainer import train
    from tests.graph_stand_in import StandInGraph
    from tests.run_state import run_state

    def stand_in(body, static, dense_opt):
        dense_opt.zero_grad(set_to_none=True)
        loss, graph = torch.zeros(()), StandInGraph()

        def replayed() -> None:
            dense_opt.zero_grad(set_to_none=True)  # a replay writes the graph's gradients anew
            loss.copy_(body(static))

        graph.body = replayed
        return graph, loss

    data = _skip_data(tmp_path / "data")
    base = tiny_overrides(**{"data.train": data, "data.eval": "", "data.batch_size": 32, "data.shuffle": "false",
                             "train.max_steps": 8, "optim.dense": "sgd", "data.on_error": "skip"})
    assert why_not(load_config(TINY, base + ["embeddings.kernels=triton"]), torch.device("cuda"), 1) is None
    eager = train(load_config(TINY, base + ["train.cuda_graphs=off"]), tmp_path / "eager", echo=lambda s: None)
    monkeypatch.setattr(trainer_module, "graphs_why_not", lambda *a: None)
    monkeypatch.setattr(graphs_module, "capture", stand_in)
    graphed = train(load_config(TINY, base), tmp_path / "graphed", echo=lambda s: None)
    assert graphed["step_mode"] == "graphs: captured at step 4, replayed 4 steps, 0 other-shape steps eager", \
        graphed["step_mode"]
    assert eager["step_mode"] == "eager (train.cuda_graphs=off)"
    got, want = run_state(tmp_path / "graphed"), run_state(tmp_path / "eager")
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_a_tensor_lr_is_filled_only_when_it_changes(monkeypatch) -> None:
    """``set_lrs`` each step: a tensor lr (what a replay reads) gets a fill only when
    the schedule changes it, a float lr is set; a step that keeps it launches nothing."""
    from dlrm.train.graphs import set_lrs

    weight = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [weight]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.5)
    opt.param_groups[0]["lr"] = torch.tensor(0.5)
    fills = []
    fill = torch.Tensor.fill_
    monkeypatch.setattr(torch.Tensor, "fill_", lambda self, v: (fills.append(v), fill(self, v))[1])
    for lr in (0.1, 0.1, 0.1, 0.05, 0.05, 0.1):
        set_lrs(opt, lr)
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(lr) and opt.param_groups[1]["lr"] == lr
    assert fills == [0.1, 0.05, 0.1]
    opt.param_groups[0]["lr"] = torch.tensor(0.3)  # a new tensor (a resume's): filled at once
    set_lrs(opt, 0.1)
    assert fills == [0.1, 0.05, 0.1, 0.1] and float(opt.param_groups[0]["lr"]) == pytest.approx(0.1)


def test_a_kept_tensor_lr_costs_no_host_read() -> None:
    """``set_lrs`` runs before every step: finding a tensor lr's last fill must not
    compare tensors. A ``weakref.WeakKeyDictionary`` keyed by the tensor did: a lookup
    makes a new weak reference, which equals the stored one by ``==`` of their
    tensors, and ``bool()`` of that is a read of the device (review of 2026-12-07:
    a wait for the GPU before every graphed step)."""
    from dlrm.train.graphs import set_lrs
    from dlrm.train.sync_audit import SyncAudit

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    opt.param_groups[0]["lr"] = torch.tensor(0.5)
    set_lrs(opt, 0.1)
    with SyncAudit() as audit:
        for _ in range(3):
            set_lrs(opt, 0.1)
    assert audit.violations == [] and audit.compute_ops == 0, (audit.violations, audit.ops)
