"""One training step of the CUDA code path, audited on the CPU.

The native engine with ``embeddings.kernels=triton`` (Triton's interpreter stands in
for the GPU), configs/bench.yaml's model cut to 8 tables at batch 64 (the interpreter
runs a program per bag and per lookup, so these set the file's time; no check here
depends on them), SGD: the trainer's whole step (forward, loss, backward, fused
sparse update, dense update) runs inside
``dlrm/train/sync_audit.SyncAudit``, which fails on any op whose output shape depends on
data and on any read of a device value by the host, and counts the ops issued.
The audit itself fails on a planted .item(), a boolean mask and repeat_interleave
without output_size. On CUDA (marker gpu): torch.cuda.set_sync_debug_mode("error")
over steady-state steps.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")

from data.generate import generate_dataset
from dlrm.config import load_config
from dlrm.parallel.distributed import init_distributed
from dlrm.parallel.parallelize import build_model
from dlrm.train import trainer as trainer_module
from dlrm.train.divergence import Diverged
from dlrm.train.inputs import resolve_data
from dlrm.train.sync_audit import SyncAudit
from tests.conftest import REPO

pytestmark = pytest.mark.kernels
SHAPE = ["generate.rows=2048", "generate.sparse=8", "generate.table_rows=[5000]",
         "generate.row_group_rows=1024", "data.batch_size=64", "train.max_steps=2", "train.log_every=0",
         "train.eval_every=0", "train.checkpoint_every=0", "train.progress=false", "data.eval="]


def audited_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str,
                 extra: tuple[str, ...] = (), diverges: bool = False) -> SyncAudit:
    """Train 2 steps; the audit of the second (steady state: lr and Adam's step are on
    the device since the first, the reader's threads are running). ``diverges``: the
    run's final save stops it (dlrm/train/divergence.py), as it must."""
    data = tmp_path / "data"
    cfg = load_config(REPO / "configs" / "bench.yaml", [*SHAPE, f"data.train={data}",
                                                        f"embeddings.kernels={kernels}", *extra])
    if not data.exists():
        generate_dataset(str(data), cfg.generate, seed=0)
    audits: list[SyncAudit] = []
    step = trainer_module.Trainer.step

    def audited(self, batches):
        if self.progress.global_step != 1:
            return step(self, batches)
        with SyncAudit() as audit:
            done = step(self, batches)
        audits.append(audit)
        return done

    monkeypatch.setattr(trainer_module.Trainer, "step", audited)
    if diverges:
        with pytest.raises(Diverged, match=r"the training loss is (nan|inf) at step 2"):
            trainer_module.train(cfg, tmp_path / f"run_{kernels}", echo=lambda s: None)
    else:
        trainer_module.train(cfg, tmp_path / f"run_{kernels}", echo=lambda s: None)
    return audits[0]


@pytest.mark.slow
def test_training_step_on_the_cuda_path_never_waits_for_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" or DEVICE.type == "cuda"
    triton = audited_step(tmp_path, monkeypatch, "triton")
    torch_path = audited_step(tmp_path, monkeypatch, "torch")
    print(f"ops per step: triton path {triton.compute_ops} (no sync), torch path "
          f"{torch_path.compute_ops} (syncs: {sorted(set(torch_path.violations))})")
    assert triton.violations == []
    assert triton.ops["triton._pooled_kernel"] == 1 and triton.ops["triton._runs_kernel"] == 1
    assert "aten.unique_consecutive" in torch_path.violations  # what the kernels removed
    assert triton.compute_ops < torch_path.compute_ops


# Hotline at a budget where hot and cold lookups both run (about a quarter of the samples
# popular, a third with the mixed dtypes; bf16 alone: every sample), as 4MB did at 26 tables, batch 256;
# three steps: the audited one (step 1) has a step before it (which split it ahead) and after it
HOTLINE = ("embeddings.placement=hotline", "hotline.budget=768KB", "hotline.profile_fraction=1.0",
           "hotline.fill_unseen=false", "train.max_steps=3")


def hotline_events(monkeypatch: pytest.MonkeyPatch, read: str) -> list[tuple[int, str]]:
    """(step, what) for each step start, mini-batch split issued, micro-batch run and
    header read (``read``: the method that reads it, ``Sizes.read`` or ``JointSplit.read_sizes``)."""
    from dlrm.train.hotline import HotlineSteps
    from embeddings.hotline.split import JointSplit, Sizes

    events: list[tuple[int, str]] = []
    at: list[int] = [-1]
    step, issue, name_of = trainer_module.Trainer.step, HotlineSteps._issue, trainer_module.micro_batch_name

    def stepping(self, batches):
        at[0] = self.progress.global_step
        events.append((at[0], "step"))
        return step(self, batches)

    monkeypatch.setattr(trainer_module.Trainer, "step", stepping)  # audited_step wraps this
    monkeypatch.setattr(HotlineSteps, "_issue", lambda self, b: events.append((at[0], "split")) or issue(self, b))
    monkeypatch.setattr(trainer_module, "micro_batch_name",
                        lambda s: events.append((at[0], name_of(s))) or name_of(s))
    if read == "sizes":
        one = Sizes.read.__func__
        monkeypatch.setattr(Sizes, "read", classmethod(lambda cls, h: events.append((at[0], "header")) or one(cls, h)))
    else:
        joint = JointSplit.read_sizes
        monkeypatch.setattr(JointSplit, "read_sizes",
                            lambda self, h: events.append((at[0], "header")) or joint(self, h))
    return events


# Step 1 of 3: the next mini-batch's split is issued before this one's pass runs (so
# before anything of it waits), and its header, the step's one host read, is read after
# it; step 1's own split was made (and its header read) during step 0. One pass over
# the mini-batch (Hotline's step).
AHEAD = ["step", "split", "hotline.mini_batch", "header"]


@pytest.mark.slow
def test_hotline_step_on_the_cuda_path_waits_only_for_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hotline trainer step (split on the device, one pass over the mini-batch: hot
    lookups, cold rows from the gather thread, the dense model once; the hot update,
    the host update queued): on the Triton path no op of the main thread syncs; the
    host reads one thing, a split's header (``Sizes.read``: the pass's shapes depend on
    it), once per step: the NEXT mini-batch's, split a step ahead
    (dlrm/train/hotline.py). The gather and host-update threads are not audited: their
    waits are theirs. The torch path's hot tier keeps its KV-gradient coalesce, one in
    the backward."""
    events = hotline_events(monkeypatch, "sizes")
    triton = audited_step(tmp_path, monkeypatch, "triton", HOTLINE)
    assert [what for step, what in events if step == 1] == AHEAD
    assert [what for step, what in events if step == 0] == ["step", "split", "header", *AHEAD[1:]]
    assert [what for step, what in events if step == 2] == ["step", "hotline.mini_batch"]
    torch_path = audited_step(tmp_path, monkeypatch, "torch", HOTLINE)
    print(f"hotline ops per step: triton path {triton.compute_ops} (no sync), torch path "
          f"{torch_path.compute_ops} (syncs: {torch_path.violations})")
    assert triton.violations == []
    if os.environ.get("TRITON_INTERPRET") == "1":  # launches counted where interpreted
        assert triton.ops["triton._pooled_kernel"] == 1 and triton.ops["triton._runs_kernel"] == 1
    assert torch_path.violations == ["aten.unique_consecutive"]


@pytest.mark.slow
def test_mixed_dtype_hotline_step_waits_only_for_its_joint_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-table dtypes under Hotline (one collection per dtype, embeddings/hotline/
    mixed.py): the mini-batch split jointly on the device, every group's header read
    in one read per step (``JointSplit.read_sizes``), the groups' lookups cut by value
    counts from the batch's host copy: no sync of its own. Every group's hot tier (its
    fp32 one too, which counts the rounding step) takes the Triton kernels with half
    rows and state, so none is left in the groups either, as in a Hotline run of one
    half dtype on that path. Reference: that bf16 run with ``kernels=torch`` keeps its
    hot tier's KV-gradient coalesce (in the backward) and its host read of the rounding
    step (hot_tier.py ``_round_rows``)."""
    from collections import Counter

    from embeddings.hotline.split import Sizes

    events = hotline_events(monkeypatch, "joint")
    single: list[int] = []
    one = Sizes.read.__func__
    monkeypatch.setattr(Sizes, "read", classmethod(lambda cls, h: single.append(1) or one(cls, h)))
    dtypes = ("embeddings.dtypes.C1=bf16", "embeddings.dtypes.C2=fp16", "embeddings.dtypes.C3=bf16")
    mixed = audited_step(tmp_path, monkeypatch, "triton", (*HOTLINE, *dtypes))
    assert [what for step, what in events if step == 1] == AHEAD and single == []  # one joint read
    shutil.rmtree(tmp_path / "run_triton")  # the same data, a fresh run
    bf16 = audited_step(tmp_path, monkeypatch, "triton", (*HOTLINE, "embeddings.dtype=bf16"))
    bf16_torch = audited_step(tmp_path, monkeypatch, "torch", (*HOTLINE, "embeddings.dtype=bf16"))
    print(f"mixed hotline ops per step: {mixed.compute_ops}; bf16 alone: {bf16.compute_ops}, "
          f"on the torch path {bf16_torch.compute_ops} (syncs: {bf16_torch.violations})")
    assert mixed.violations == [] and bf16.violations == []
    if os.environ.get("TRITON_INTERPRET") == "1":  # launches counted where interpreted
        # three groups (fp32, bf16, fp16): a pooled launch and an update each
        assert mixed.ops["triton._pooled_kernel"] == 3 and mixed.ops["triton._runs_kernel"] == 3
        assert bf16.ops["triton._runs_kernel"] == 1  # one update for the step
    # (bf16 rows: twice as many hot in the budget; this step's lookups may all be hot)
    syncs = Counter(bf16_torch.violations)
    assert set(syncs) == {"aten.unique_consecutive", "aten._local_scalar_dense"}
    assert syncs["aten._local_scalar_dense"] == 1  # the rounding step, read once by the step's update


BENCH = REPO / "configs" / "bench.yaml"
SHRUNK = ["generate.rows=1024", "generate.table_rows=[1000]", "generate.row_group_rows=512",
          "generate.file_rows=1024", "data.batch_size=256", "embeddings.kernels=triton",
          "optim.dense=sgd", "optim.sparse=sgd", "train.progress=false"]


def bench_trainer(tmp_path: Path) -> trainer_module.Trainer:
    generated = load_config(BENCH, SHRUNK)
    generate_dataset(str(tmp_path / "data"), generated.generate, seed=0)
    cfg = load_config(BENCH, [*SHRUNK, f"data.train={tmp_path / 'data'}", f"train.device={DEVICE.type}"])
    info = init_distributed(cfg.train.backend, cfg.train.device)
    data = resolve_data(cfg, tmp_path / "run")
    model = build_model(cfg, data.schema, info.device, info)
    return trainer_module.Trainer(cfg, tmp_path / "run", model, data, info, lambda s: None)


def test_audit_flags_item_and_boolean_mask() -> None:
    x = torch.arange(6.0)
    with SyncAudit() as audit:
        (x * 2).sum().item()
    assert audit.violations == ["aten._local_scalar_dense"]
    with SyncAudit() as audit:
        x[x > 2].sum()
    assert any("boolean mask" in v or "nonzero" in v for v in audit.violations), audit.violations
    with SyncAudit() as audit:
        torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1, 1, 1]))
    assert audit.violations
    with SyncAudit() as audit:
        (x * 2 + 1).sum()
    assert audit.violations == [] and audit.compute_ops == 3


@pytest.mark.gpu
def test_cuda_steps_do_not_synchronise(tmp_path: Path) -> None:
    """On CUDA (compiled Triton kernels, fused dense SGD): torch's sync debug mode
    raises on any host synchronisation over three steady-state steps, and the audit
    sees none; the op count is printed for the issue's target (40)."""
    trainer = bench_trainer(tmp_path)
    assert trainer.info.device.type == "cuda"
    for _ in range(2):
        trainer.step(trainer._next_batches())
    steps = [[b.to(trainer.info.device) for b in trainer._next_batches()] for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batches in steps[:2]:
            trainer.step(batches)
        with SyncAudit() as audit:
            trainer.step(steps[2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"cuda bench step: {audit.compute_ops} compute ops; {dict(audit.ops.most_common(8))}")
    assert audit.violations == [], audit.violations


@pytest.mark.slow
def test_fp16_step_on_the_cuda_path_counts_overflow_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16 tables on the Triton path with a learning rate that sends weights past
    65504: the fused update counts the overflow on the device and the step reads
    nothing; the run says it (embeddings/narrow.py's line) by its end, where the
    trainer's final checkpoint waits for the device anyway. Reference: the torch path's
    run, which warns at its update, names the same tables."""
    from embeddings import narrow

    named = {}
    for kernels in ("triton", "torch"):
        narrow._said.clear()
        audit = audited_step(tmp_path, monkeypatch, kernels, ("embeddings.dtype=fp16", "optim.sparse_lr=1e9"),
                             diverges=True)  # inf weights: the warning comes before the stop
        lines = [line for line in capsys.readouterr().err.splitlines() if "overflow fp16" in line]
        named[kernels] = sorted({line.split(":")[1].strip() for line in lines})
        if kernels == "triton":
            assert audit.violations == [], audit.violations
            assert audit.ops["triton._runs_kernel"] == 1
            assert len(lines) == len(named["triton"])  # one line a table (the torch path: one a step)
    assert named["triton"] and named["triton"] == named["torch"], named
