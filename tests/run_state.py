"""Every parameter of a finished run, as one process sees it (for comparisons)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from dlrm.checkpoint import manager as ck
from dlrm.checkpoint import manifest
from dlrm.config import Config, from_dict
from dlrm.parallel.parallelize import build_model


def run_state(run: Path) -> dict[str, torch.Tensor]:
    """Dense tensors and whole embedding tables (with optimizer state) of ``run``,
    loaded into a single-process model whatever world size wrote it."""
    ckpt = ck.find_checkpoint(run)
    meta = manifest.load_meta(ckpt)
    cfg = from_dict(Config, meta["config"], "")
    cfg.train.accumulate = 1
    cfg.embeddings.placement = "sharded"  # a plain model holds every table
    schema = manifest.schema_from_json(meta["schema"])
    model = build_model(cfg, schema)
    with contextlib.closing(model):  # the torchrec backend's model owns a process group
        ck.load_checkpoint(ckpt, model, None, None, schema)
        state = model.export_state()
    flat = {f"dense.{k}": v.clone() for k, v in state["dense"].items()}
    flat.update({f"tables.{k}": v.clone() for k, v in state["tables"].items()})
    return flat


# Element-wise Adagrad divides each element's gradient by its own sqrt(sum g²), so an
# element touched once or twice moves by about lr whatever the size of its gradient:
# rounding of a tiny, partly cancelled gradient (tiny.yaml's are ~1e-5) becomes an
# error of the step itself. Measured on tiny.yaml, Hotline against plain, 12 steps:
# 1.5e-5 relative on the worst table (its "sum" state: 1e-6; Adam's tables: 5e-7).
RTOL = {"adagrad": 5e-5}


def assert_states_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
                        rtol: float = 1e-5) -> None:
    """Every tensor within ``rtol`` relative, measured as ||got - want|| <= rtol ||want||.

    Norm-wise: adaptive optimizers (Adagrad, Adam) turn rounding-level differences
    of near-zero gradients (another summation order across ranks) into visible
    per-element differences of near-zero weights, while the tensor stays equal.
    ``RTOL`` holds the optimizers that need more than 1e-5."""
    assert got.keys() == want.keys(), label
    for key, expected in want.items():
        diff = float((got[key].double() - expected.double()).norm())
        scale = float(expected.double().norm())
        assert diff <= rtol * scale + 1e-7, f"{label} {key}: |diff| {diff:.3g} vs |want| {scale:.3g}"
