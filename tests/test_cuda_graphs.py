"""train.cuda_graphs on the CPU: where no graph can run, auto trains eager and says
why, on refuses in one line (tests/test_gpu.py: on CUDA a replayed run equals an eager one)."""

from __future__ import annotations

from pathlib import Path

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
