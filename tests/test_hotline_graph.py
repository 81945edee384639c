"""hotline.graph_step (dlrm/train/hotline_graph.py): Hotline's whole step static.

Without a GPU the static step runs uncaptured, on the Triton kernels in Triton's
interpreter: its buffers, the two-tier lookup, the hot rows' update in the kernel
and the cold rows' gradient sent home must train exactly as ordinary training (the
reference: the same run with every table on one device). On a GPU the same tests
capture and replay it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tests.kernel_cases import DEVICE  # sets TRITON_INTERPRET=1 without a GPU

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels  # scripts/gpu_session.sh runs them on a GPU, captured

from dlrm.config import load_config
from dlrm.train.sync_audit import SyncAudit
from dlrm.train.trainer import Trainer, train
from tests.conftest import FEW_TABLES, TINY, tiny_overrides
from tests.gpu_cases import DEVICE_RTOL, OPTIMIZER_RTOL
from tests.run_state import RTOL, assert_states_close, run_state
from tests.test_hotline_train import run as run_tiny


def run(tiny_data, out: Path, *extra: str) -> dict:
    """tests/test_hotline_train.py's run on 8 tables."""
    return run_tiny(tiny_data, out, FEW_TABLES, *extra)


def tolerance(optim: str) -> float:
    """The Hotline tests' on the CPU; on a GPU two CUDA runs (atomics, cuBLAS's orders)
    differ more: tests/gpu_cases.py's DEVICE_RTOL, 1e-4, and its OPTIMIZER_RTOL for Adam
    (the 2026-11-27 H200 run: static host_embedding against ordinary, Adam, 1.26e-4)."""
    if DEVICE.type == "cpu":
        return RTOL.get(optim, 1e-5)
    return max(DEVICE_RTOL, OPTIMIZER_RTOL.get(f"optim.sparse={optim}", 0.0))


# a budget of about a tenth of the rows (8 x 1000 x 16 fp32): most samples have a cold lookup
STATIC = ("embeddings.placement=hotline", "hotline.budget=50KB", "embeddings.kernels=triton",
          "hotline.graph_step=on", "data.batch_size=32")  # 32: interpreted kernels, a step's time


def audited_bodies(monkeypatch) -> list[SyncAudit]:
    """The trainer's captured body audited (dlrm/train/sync_audit.py) each time it runs:
    the audits, filled as the run goes."""
    audits: list[SyncAudit] = []
    body = Trainer._captured_body

    def audited(self, part):
        with SyncAudit() as audit:
            loss = body(self, part)
        audits.append(audit)
        return loss

    monkeypatch.setattr(Trainer, "_captured_body", audited)
    return audits


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "adam"])  # row-wise Adagrad: the refresh and bf16 tests
def test_static_hotline_step_equals_ordinary_training(tiny_data, tmp_path: Path, optim: str) -> None:
    """3 eager warm-up steps, then static ones (single-hot tiny data: every batch fits).
    Steps 4 and 5 under train.profile_mode=python, which changes nothing they compute:
    the static steps are profiled too (they were not: the GPU bench's hostprof row of
    2026-11-28 would have written nothing)."""
    steps = ("train.max_steps=7", f"optim.sparse={optim}", "optim.dense=adam")  # adam: capturable
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=32")
    profiled = ("train.profile_mode=python", "train.profile_start=4", "train.profile_steps=2")
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC, *profiled)
    text = (tmp_path / "hot" / "profile" / "rank-0-python.txt").read_text()
    assert text.startswith("steps 4..5, rank 0") and "hotline_graph.py" in text.split("== by with callees")[1]
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), f"static hotline {optim}",
                        tolerance(optim))
    assert summary["step_mode"].startswith("hotline step static: 4 steps"), summary["step_mode"]
    # captured on a GPU: the replays' own GPU time beside the step's (graphs.ReplayTimer)
    assert ("ms of GPU time a replay" in summary["step_mode"]) == (DEVICE.type == "cuda"), summary["step_mode"]
    stats = summary["hotline"]
    assert stats["hot_hit_rate"] < 0.9 and stats["popular_share"] < 0.5  # cold rows staged and sent home


@pytest.mark.slow
def test_static_hotline_step_with_refreshes_equals_ordinary_training(tiny_data, tmp_path: Path) -> None:
    """hotline.refresh_every swaps the hot set between static steps. Each set keeps its
    size (the rows hot now fill what the 2-step window leaves of the budget) and is
    copied into the hot tier's tensors: on a GPU the step is captured once and replays
    across the refreshes."""
    steps = ("train.max_steps=8", "optim.sparse=rowwise_adagrad", "optim.dense=adam")
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=32")
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC, "hotline.refresh_every=2")
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), "static hotline refresh",
                        tolerance("rowwise_adagrad"))
    assert summary["hotline"]["refreshes"] >= 2
    assert summary["step_mode"].startswith("hotline step static: 5 steps"), summary["step_mode"]
    if DEVICE.type == "cuda":
        assert "captured 1x" in summary["step_mode"], summary["step_mode"]


def test_graph_step_on_says_why_it_runs_eager(tiny_data, tmp_path: Path) -> None:
    """``on`` where the step cannot be static (the hot tier on torch's kernels): one
    warning line, the run trains eager."""
    lines: list[str] = []
    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": ""})
                      + ["train.max_steps=2", "embeddings.placement=hotline", "hotline.graph_step=on",
                         "embeddings.kernels=torch"])
    summary = train(cfg, tmp_path / "run", echo=lines.append)
    warned = [line for line in lines if "hotline.graph_step" in line]
    assert warned == [("warning: hotline.graph_step=on: the step runs eager: the hot tier is not on the "
                      "Triton kernels")], warned
    assert "static" not in summary["step_mode"]


@pytest.mark.slow
def test_the_static_step_body_has_no_host_sync(tiny_data, tmp_path: Path, monkeypatch) -> None:
    """What the graph holds (the trainer's body on the static buffers) has no op a CUDA
    capture refuses: no host read, no data-dependent shape, no copy between devices
    (dlrm/train/sync_audit.py), and it is a few dozen launches (the eager Hotline step
    issues some 130; the README's count)."""
    audits = audited_bodies(monkeypatch)
    # SGD on the dense side: CPU Adam reads its step on the host (CUDA's capturable one does not)
    summary = run(tiny_data, tmp_path / "hot", "train.max_steps=5", "optim.sparse=adam", "optim.dense=sgd", *STATIC)
    assert summary["step_mode"].startswith("hotline step static: 2 steps"), summary["step_mode"]
    assert len(audits) == (2 if DEVICE.type == "cpu" else 1)  # CUDA: the body runs at the capture only
    for audit in audits:
        assert audit.violations == [], audit.violations
        # one lookup launch over both tiers; one sort and one update launch for both (issue 22),
        # and one update launch (no sort: presorted) for the staged cold rows (cold_stage.py)
        assert audit.ops["triton._two_tier_kernel"] == 1 and audit.ops["triton._runs_kernel"] == 2
        assert audit.ops["aten.sort"] == 1, {k: v for k, v in audit.ops.items() if "sort" in k}
        print(f"static step body: {audit.compute_ops} ops")


@pytest.mark.slow
def test_static_hotline_step_with_bf16_tables_equals_ordinary_training(tiny_data, tmp_path: Path) -> None:
    """bf16 tables: the static step's hot update rounds stochastically in the kernel at
    the rows' full-table coordinates, the host tier as the eager step's (batch 32:
    interpreted, a rounded row's update is slow)."""
    steps = ("train.max_steps=5", "optim.sparse=rowwise_adagrad", "optim.dense=adam", "embeddings.dtype=bf16")
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=32")
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC)
    hot = run_state(tmp_path / "hot")
    assert hot["tables.C1.weight"].dtype == torch.bfloat16
    assert_states_close(hot, run_state(tmp_path / "plain"), "static hotline bf16", tolerance("rowwise_adagrad"))
    assert summary["step_mode"].startswith("hotline step static: 2 steps"), summary["step_mode"]


@pytest.mark.slow
def test_static_hotline_step_under_bf16_autocast_equals_ordinary_training(tiny_data, tmp_path: Path) -> None:
    """train.precision=bf16: the captured body runs the dense model under autocast, as
    the eager step does (on a GPU: autocast entered and left inside the capture); the
    lookups, their sums and updates stay fp32. Reference: ordinary training under the
    same autocast (``precision_fallback=none``: this CPU emulates bf16)."""
    steps = ("train.max_steps=5", "optim.sparse=rowwise_adagrad", "optim.dense=adam", "train.precision=bf16",
             "train.precision_fallback=none")
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=32")
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC)
    assert summary["step_mode"].startswith("hotline step static: 2 steps"), summary["step_mode"]
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), "static hotline autocast",
                        tolerance("rowwise_adagrad"))


def test_the_buffers_are_made_for_a_full_batch_only() -> None:
    """A short batch (an epoch's last) reaching the first static step runs eager: buffers
    made from it would fit no full batch after it."""
    from data.batch import Batch
    from data.jagged import JaggedFeatures
    from dlrm.train.hotline_graph import HotlineGraph

    def batch(size: int) -> Batch:
        sparse = JaggedFeatures(["a", "b"], torch.zeros(2 * size, dtype=torch.int64),
                                torch.ones(2 * size, dtype=torch.int64))
        return Batch(torch.zeros(size, 3), sparse, torch.zeros(size))

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    graph = HotlineGraph(lambda b: torch.zeros(()), opt, None, print, capture=False, batch_size=8)
    assert not graph.fits(batch(5)) and graph.fits(batch(8))


@pytest.mark.slow
def test_the_cold_path_copies_only_the_cold_rows_and_their_ids(tiny_data, tmp_path: Path, monkeypatch) -> None:
    """Over a run with static steps, the host tier's copies between host and device are,
    per step with U cold rows, exactly the U ids (D2H), the U rows (H2D) and U rows back
    (D2H, fp32: the eager steps' gradient rows, the static steps' updated rows, SGD
    staging no state): nothing table-sized, nothing twice (issue 22)."""
    from embeddings.hotline.host_local import LocalHostTier

    gathered: list[tuple[int, int]] = []  # (U, row bytes) of each gather
    gather = LocalHostTier.gather_cold

    def counted(self, micro, device):
        cold = gather(self, micro, device)
        gathered.append((cold.rows.shape[0], cold.rows.shape[1] * cold.rows.element_size()))
        return cold

    monkeypatch.setattr(LocalHostTier, "gather_cold", counted)
    tiers: list[LocalHostTier] = []
    init = LocalHostTier.__init__
    monkeypatch.setattr(LocalHostTier, "__init__", lambda self, *a, **k: (tiers.append(self), init(self, *a, **k))[1])
    summary = run(tiny_data, tmp_path / "hot", "train.max_steps=6", "optim.sparse=sgd", *STATIC)
    assert summary["step_mode"].startswith("hotline step static: 3 steps"), summary["step_mode"]
    (tier,) = tiers
    steps = [(u, row) for u, row in gathered if u]
    assert len(steps) == 6  # every step had cold rows (budget: a tenth of the rows)
    assert tier.copied["h2d"] == sum(u * row for u, row in steps)
    assert tier.copied["d2h"] == sum(u * 8 + u * 16 * 4 for u, _ in steps)  # ids, fp32 rows back (dim 16)
    assert tier.copied["copies"] == 3 * len(steps)


@pytest.mark.slow
def test_static_step_with_no_hot_row_equals_ordinary_training(tiny_data, tmp_path: Path) -> None:
    """``dlrm bench``'s host_embedding_static: no hot row (every lookup cold, the hot tier
    empty) and no pipeline (the gather inside the step), the step static."""
    steps = ("train.max_steps=6", "optim.sparse=adam", "optim.dense=adam", "data.batch_size=32")
    run(tiny_data, tmp_path / "plain", *steps)
    summary = run(tiny_data, tmp_path / "host", *steps, *STATIC, "hotline.budget=1B", "hotline.pipeline=false")
    assert_states_close(run_state(tmp_path / "host"), run_state(tmp_path / "plain"), "static host_embedding",
                        tolerance("adam"))
    assert summary["hotline"]["hot_hit_rate"] == 0.0
    assert summary["step_mode"].startswith("hotline step static: 3 steps"), summary["step_mode"]


@pytest.mark.slow
@pytest.mark.parametrize("cold_path", ["host", "mapped"])
def test_static_hotline_step_with_tables_of_several_dtypes_equals_ordinary_training(tiny_data, tmp_path: Path,
                                                                                     monkeypatch, cold_path: str) -> None:
    """Per-table dtypes (embeddings.dtypes): a hot tier per dtype group, each with its own
    static buffers (the cold rows in its type), lookup launch and fused update; each
    group's cold rows updated on the device and written back (cold_stage.py). Reference: ordinary training
    with the same dtypes (the same stochastic rounding, keyed by full-table
    coordinates). The body a graph would hold passes the sync audit: one lookup and
    one update launch per group, and one for each staged group's cold rows.
    hotline.cold_path=mapped: each group's host tables read and written in place."""
    steps = ("train.max_steps=5", "optim.sparse=rowwise_adagrad", "optim.dense=adam",
             "embeddings.dtypes.C1=fp32", "embeddings.dtypes.C2=fp16", "embeddings.dtype=bf16")
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=32")
    audits = audited_bodies(monkeypatch)
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC, f"hotline.cold_path={cold_path}")
    assert summary["hotline"]["cold_in_place"] == float(cold_path == "mapped")
    assert audits and all(a.violations == [] for a in audits), [a.violations for a in audits]
    assert all(a.ops["triton._two_tier_kernel"] == 3 and a.ops["triton._runs_kernel"] == 3 + 3 for a in audits)
    hot = run_state(tmp_path / "hot")
    assert (hot["tables.C1.weight"].dtype, hot["tables.C2.weight"].dtype, hot["tables.C3.weight"].dtype) == (
        torch.float32, torch.float16, torch.bfloat16)
    assert_states_close(hot, run_state(tmp_path / "plain"), "static hotline mixed dtypes", tolerance("rowwise_adagrad"))
    assert summary["step_mode"].startswith("hotline step static: 2 steps"), summary["step_mode"]
    stats = summary["hotline"]
    assert stats["hot_hit_rate"] < 0.9 and stats["popular_share"] < 0.5  # every group's cold rows staged


@pytest.mark.slow
@pytest.mark.parametrize("optim,dtype,cold_path", [("rowwise_adagrad", "fp32", "host"), ("adam", "fp32", "host"),
                                                   ("adagrad", "bf16", "host"), ("adam", "bf16", "mapped")])
def test_static_steps_update_their_cold_rows_on_the_device(tiny_data, tmp_path: Path, monkeypatch,
                                                           optim: str, dtype: str, cold_path: str) -> None:
    """fp32 or bf16 tables (bf16: stochastically rounded by the kernel at each staged
    row's full-table coordinates), their state staged with them (embeddings/hotline/cold_stage.py;
    adagrad's in bf16 too, rounded in its own stream; Adam's step the hot tier's count): a static step updates
    its staged cold rows and their state on the device and writes them back; no cold
    gradient goes home. The next gather does not wait for that write-back: the rows it
    read too early are patched in the next replay, or, before the eager step forced in
    the middle here (as another shape would be), read again on the host. Reference:
    ordinary training. What a graph would hold passes the sync audit.
    hotline.cold_path=mapped (embeddings/hotline/mapped.py): the device reads the rows
    in place, on the step loop's thread, with the same waits (on a GPU: the tables
    registered with CUDA, read over the bus while the write-back's stores may run)."""
    from dlrm.train.hotline_graph import HotlineGraph
    from embeddings.hotline.host_local import LocalHostTier

    calls = {"write_back": 0, "gradients": 0, "stale": 0, "fits": 0}
    write_back, resolve, receive = LocalHostTier.write_back, LocalHostTier.resolve, LocalHostTier._receive
    fits, store = HotlineGraph.fits, LocalHostTier._store
    gather_threads: set[str] = set()
    gather = LocalHostTier.gather_cold

    def gather_on(self, *a):
        gather_threads.add(threading.current_thread().name)
        return gather(self, *a)

    tier_writes = {"stored": 0}
    apply = LocalHostTier._apply

    def slow_apply(self, kept, *a):
        if kept:  # an eager step's update still running when the next step reads its rows
            time.sleep(0.3)
        return apply(self, kept, *a)

    def slow_store(self, *a):
        tier_writes["stored"] += 1
        time.sleep(0.3)  # a write-back still running when the next gather reads: that one's rows are stale
        return store(self, *a)

    def counted_write_back(self, *a):
        calls["write_back"] += 1
        return write_back(self, *a)

    def counted_resolve(self, cold, *a, **k):
        calls["stale"] += cold.stale is not None
        return resolve(self, cold, *a, **k)

    def counted_receive(self, *a):
        calls["gradients"] += 1
        return receive(self, *a)

    def fits_but_one(self, batch):
        calls["fits"] += 1
        return calls["fits"] != 3 and fits(self, batch)  # the 3rd static-eligible step: eager

    monkeypatch.setattr(LocalHostTier, "write_back", counted_write_back)
    monkeypatch.setattr(LocalHostTier, "_store", slow_store)
    monkeypatch.setattr(LocalHostTier, "_apply", slow_apply)
    monkeypatch.setattr(LocalHostTier, "resolve", counted_resolve)
    monkeypatch.setattr(LocalHostTier, "_receive", counted_receive)
    monkeypatch.setattr(HotlineGraph, "fits", fits_but_one)
    monkeypatch.setattr(LocalHostTier, "gather_cold", gather_on)
    steps = ("train.max_steps=9", f"optim.sparse={optim}", "optim.dense=adam", f"embeddings.dtype={dtype}",
             f"embeddings.state_dtype={dtype}")
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=32")
    audits = audited_bodies(monkeypatch)
    # no hot row: consecutive steps share their popular rows, all cold
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC, "hotline.budget=1B",
                  f"hotline.cold_path={cold_path}")
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), f"staged cold rows {optim}",
                        tolerance(optim))
    # what a graph holds: the patch, the staged rows' update (a second update launch, no
    # sort) and the keep (bf16: the rows' tables found for their rounding, a sorted search)
    # have no op a capture refuses; sorted searches: the main update's run heads (not a
    # cummax: one thread block on CUDA), none for the staged rows' (one lookup a run), and
    # bf16's tables
    assert audits and all(a.violations == [] for a in audits), [a.violations for a in audits]
    assert all(a.ops["triton._runs_kernel"] == 2 and a.ops["aten.sort"] == 1 and a.ops["triton._patch_kernel"] == 1
               and a.ops["triton._keep_kernel"] == 1 and a.ops["aten.searchsorted"] == 1 + (dtype == "bf16")
               and a.ops["aten.cummax"] == 0 and a.ops["triton._segments_kernel"] == 1
               for a in audits), [dict(a.ops) for a in audits]
    assert summary["step_mode"].startswith("hotline step static: 5 steps"), summary["step_mode"]
    assert calls["write_back"] == 5
    assert calls["gradients"] == 4  # the 3 warm-up steps and the eager one sent gradients home
    stats = summary["hotline"]
    if cold_path == "host":
        assert calls["stale"] == 1  # the eager step's gather read rows the write-back before it wrote
        assert stats["late_rows"] > 0  # rows of consecutive steps: patched, or read again
    else:  # read in place: by the step loop itself, no gather thread; written back in place,
        # before the next read on the device's stream: no row read before its write
        assert calls["stale"] == 0 and stats["late_rows"] == 0
        assert tier_writes["stored"] == 0  # no write-back stored by the host
    assert stats["cold_in_place"] == float(cold_path == "mapped")
    assert (gather_threads == {threading.current_thread().name}) == (cold_path == "mapped"), gather_threads


@pytest.mark.slow
def test_cold_update_host_sends_the_gradient_home(tiny_data, tmp_path: Path, monkeypatch) -> None:
    """``hotline.cold_update=host``: the static step's cold rows' gradient goes home and
    the host tier applies it (no write-back), equal to ordinary training too."""
    from embeddings.hotline.host_local import LocalHostTier

    write_backs: list[int] = []
    write_back = LocalHostTier.write_back
    monkeypatch.setattr(LocalHostTier, "write_back", lambda self, *a: (write_backs.append(1), write_back(self, *a)))
    steps = ("train.max_steps=6", "optim.sparse=rowwise_adagrad", "optim.dense=adam")
    run(tiny_data, tmp_path / "plain", *steps, "data.batch_size=32")
    summary = run(tiny_data, tmp_path / "hot", *steps, *STATIC, "hotline.cold_update=host")
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "plain"), "cold_update=host",
                        tolerance("rowwise_adagrad"))
    assert summary["step_mode"].startswith("hotline step static: 3 steps"), summary["step_mode"]
    assert write_backs == []
