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


# A half-precision table's elements may differ by one step of their type in this share
# of elements at most (``assert_states_close``).
HALF_FLIP_SHARE = 1e-3


def assert_states_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
                        rtol: float = 1e-5) -> None:
    """Every tensor within ``rtol`` relative, measured as ||got - want|| <= rtol ||want||.

    Norm-wise: adaptive optimizers (Adagrad, Adam) turn rounding-level differences
    of near-zero gradients (another summation order across ranks) into visible
    per-element differences of near-zero weights, while the tensor stays equal.
    ``RTOL`` holds the optimizers that need more than 1e-5.

    fp16 / bf16 tensors: a rounding-level difference of the fp32 update (Hotline's hot
    and cold parts summed apart) can send a stochastic rounding to the other neighbour:
    one step of the type, 1e-3 (fp16) or 8e-3 (bf16) of the value, which alone can
    outweigh 1e-5 of the whole table's norm (2 elements of 16,000 in tiny.yaml's fp16
    table on one machine and not on another). Up to ``HALF_FLIP_SHARE`` of the elements
    may differ by at most one step; the rest is held to ``rtol``. A bug differs in many
    more elements, or by more (round-to-nearest for stochastic: most updated ones)."""
    assert got.keys() == want.keys(), label
    for key, expected in want.items():
        g, w = got[key].double(), expected.double()
        if expected.dtype in (torch.float16, torch.bfloat16):
            step = torch.finfo(expected.dtype).eps * torch.maximum(g.abs(), w.abs())
            flipped = (g != w) & ((g - w).abs() <= step + torch.finfo(expected.dtype).smallest_normal)
            assert int(flipped.sum()) <= HALF_FLIP_SHARE * g.numel(), (
                f"{label} {key}: {int(flipped.sum())} of {g.numel()} elements one step of "
                f"{expected.dtype} apart (at most {HALF_FLIP_SHARE:.1%})")
            g = torch.where(flipped, w, g)
        diff = float((g - w).norm())
        scale = float(w.norm())
        assert diff <= rtol * scale + 1e-7, f"{label} {key}: |diff| {diff:.3g} vs |want| {scale:.3g}"
