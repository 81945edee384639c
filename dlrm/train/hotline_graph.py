"""``hotline.graph_step``: Hotline's whole step captured once, then replayed.

The eager Hotline step is host-bound on a GPU: one H200 took 8.6 ms a step to
dispatch 3.1 ms of device work (134 kernels), and graphing the dense model and the
split (hotline.graph_dense, graph_split) left it at 0.42x the captured native step.
Here the whole step is one replay; only what needs the host stays outside:

    host (main thread)                            device
    split of t, made a step ahead; header read    (split stream; dlrm/train/hotline.py)
    cold rows of t: gather thread, H2D ──────────► rows [U, D]       (copy stream)
    ``load``: the split's lookups, the U rows ───► static buffers    (device to device)
    replay ──────────────────────────────────────► two-tier lookup, dense model, loss,
                                                   backward: hot rows updated in the
                                                   kernel, cold rows' gradient by row;
                                                   the dense optimizer
    cold_grad[:U] home (host tier) ◄──────────────  D2H; the host-update thread applies it
    or, staged (embeddings/hotline/cold_stage.py, hotline.cold_update=device, the default):
    rows[:U], state[:U] home ◄────────────────────  the cold rows patched from the last
                                                   step's results, updated in the replay;
                                                   the host stores them, and the next
                                                   gather waits for no update of this step

The buffers are embeddings/hotline/static_step.py's: every shape is the batch's (N
lookups, F*B bags, C = N cold rows), so one capture serves every split of a
same-shaped batch. Another shape (an epoch's short last batch) runs that step
eager. A refresh (hotline.refresh_every) of a hot set the same size copies the new
rows into the hot tier's tensors (embeddings/hotline/hot_tier.py, ``load``): the graph,
which reads them by address, replays on; one of another size (a budget the profile
does not fill yet) makes new tensors, and the next step captures again (``captures``
counts them).

Exact as the eager step (tests/test_hotline_graph.py): the same lookups, sums,
updates, and the host tier's order of reads and writes (a gather of step t+1
rereads the rows step t's update writes, host_local.py; staged, step t+1's replay
takes them from step t's results, cold_stage.py).

Without CUDA (hotline.graph_step=on with the hot tier on interpreted Triton kernels,
as the tests run it) the same static step runs uncaptured: its buffers and updates
are checked, not its speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from data.batch import Batch
from dlrm.train.graphs import ReplayTimer, capture, tensor_lrs
from embeddings.hotline.lookups import HOT_ONLY, ColdInFlight, ColdRows
from embeddings.hotline.mixed import GroupCold
from embeddings.hotline.split import DeviceSplit, JointSplit


def why_not(cfg: Any, embeddings: Any, world_size: int) -> str | None:
    """Why this run's Hotline step cannot be static (None: it can). Every dense
    optimizer's step can be captured (Adagrad: dlrm/train/adagrad.py where torch has no
    fused CUDA kernel)."""
    reasons = [
        (world_size > 1, "more than one process (the host tier's all-to-alls and DDP run eager)"),
        (not embeddings.on_triton(), "the hot tier is not on the Triton kernels"),
        (cfg.train.accumulate != 1, "train.accumulate > 1"),
        (cfg.train.profile_steps > 0 and cfg.train.profile_mode == "torch",
         "train.profile_steps (profiled steps run eager; train.profile_mode=python keeps them)"),
    ]
    return next((why for broken, why in reasons if broken), None)


class HotlineGraph:
    """The static step's buffers, its graph and what it counts (module docstring)."""

    def __init__(self, body: Callable[[Batch], torch.Tensor], dense_opt: torch.optim.Optimizer,
                 embeddings: Any, say: Callable[[str], None], capture: bool, batch_size: int) -> None:
        """``body(batch)``: forward, loss, backward, dense update; returns the summed
        loss (the trainer's captured body). ``capture``: on CUDA; else uncaptured.
        ``batch_size``: the run's; the buffers are made for a batch of that many."""
        self.body, self.dense_opt, self.embeddings, self.say = body, dense_opt, embeddings, say
        self.capture, self.batch_size = capture, batch_size
        self.static: Batch | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.version: object = None  # the hot tier's tensors the graph was captured on
        self.loss: torch.Tensor | None = None
        self.failed: str | None = None
        self.steps = self.replays = self.captures = self.eager = 0
        self.capture_s = 0.0  # seconds the captures took (a recapture is a pause of the run)
        self.timer = ReplayTimer()
        if capture:
            tensor_lrs(dense_opt)

    def fits(self, batch: Batch) -> bool:
        """Whether host ``batch`` can take the static step: no capture failed, and it
        fits the buffers (B samples, at most their N ids, the dense width), or none
        were made yet and it has the run's batch size."""
        s = self.static
        if self.failed is not None:
            return False
        if s is None:  # not made from a short batch (an epoch's last): the full ones would not fit
            return batch.size == self.batch_size
        return s.sparse.fits_batch(batch.sparse) and tuple(batch.dense.shape) == tuple(s.dense.shape)

    def run(self, part: Batch, split: DeviceSplit | JointSplit, cold: Any, step: int) -> torch.Tensor | None:
        """One step on ``part`` (on the device; its ``split``, a ``JointSplit`` for
        tables of several dtypes; its cold rows as the Hotline pass hands them): buffers
        loaded, the graph replayed (captured first, or again after a refresh that made
        new hot-tier tensors); the cold gradient sent home. The step's summed loss, or
        None where the capture failed (then eager)."""
        rows = _cold_rows(cold)
        if self.static is None:  # StaticLookups, or MixedStatic: one per dtype group
            lookups = self.embeddings.static_buffers(split)
            self.static = Batch(part.dense.clone(), lookups, part.labels.clone())
        static = self.static
        rows = self.embeddings.staged_cold(static.sparse, rows)  # cold_stage.py: patched or read again
        static.dense.copy_(part.dense, non_blocking=True)
        static.labels.copy_(part.labels, non_blocking=True)
        static.sparse.load(split, rows)
        if not self.capture:
            self.dense_opt.zero_grad(set_to_none=True)
            loss = self.body(static)
        elif self.graph is None or self.version != self.embeddings.static_version:
            loss = self._capture(step)
            if loss is None:
                return None
        else:
            self.timer.replay(self.graph)
            self.replays += 1
            loss = self.loss
        self.embeddings.send_static_cold(static.sparse, rows)
        self.steps += 1
        return loss

    def _capture(self, step: int) -> torch.Tensor | None:
        """Capture the step on the loaded buffers and replay it once; None (said once)
        where the capture fails: the run goes on eager."""
        assert self.static is not None
        self.graph = None
        t0 = time.perf_counter()
        try:
            graph, self.loss = capture(self.body, self.static, self.dense_opt)
        except Exception as e:  # noqa: BLE001 - a capture error is a RuntimeError of any kind
            self.failed = f"capture failed at step {step}: {str(e).splitlines()[0][:200]}"
            self.say(f"warning: hotline.graph_step: {self.failed}; the step runs eager")
            torch.cuda.synchronize()
            return None
        self.graph, self.version = graph, self.embeddings.static_version
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        graph.replay()
        self.replays += 1
        return self.loss

    def summary(self) -> str:
        """What the run's static steps were, for the step mode line."""
        if self.failed:
            return f"hotline step eager ({self.failed})"
        how = (f"captured {self.captures}x in {1000 * self.capture_s / max(self.captures, 1):.0f} ms each, replayed"
               if self.capture else "uncaptured (no CUDA device)")
        return (f"hotline step static: {self.steps} steps ({how}), {self.eager} other-shape steps "
                f"eager{self.timer.summary()}{self._cold_update()}")

    def _cold_update(self) -> str:
        """Where the static steps' cold rows were updated (embeddings/hotline/cold_stage.py)."""
        if self.static is None:
            return ""
        first = getattr(self.static.sparse, "parts", [self.static.sparse])[0]  # MixedStatic: every group alike
        return ", cold rows updated on the device" if first.stage is not None else ", cold rows' gradient sent home"


def _cold_rows(cold: Any) -> ColdRows | GroupCold | None:
    """The pass's cold rows (each dtype group's: ``GroupCold``), waited for (None: every
    lookup hot)."""
    if cold is HOT_ONLY:
        return None
    if isinstance(cold, ColdInFlight):
        cold = cold.result()
    assert isinstance(cold, (ColdRows, GroupCold))
    return cold
