"""``train.cuda_graphs``: the whole training step captured once, replayed every step.

    steps 0 .. WARMUP-1   eager (cuBLAS handles, the allocator, lr and Adam's step
                          moved to the device, the dense optimizer's state made)
    step WARMUP           the batch is copied into static buffers and the step is
                          captured: forward, loss, backward (the Triton sparse update
                          runs inside it), the fused dense optimizer; then replayed
    later steps           copy the batch into the static buffers (device to device),
                          set the lrs on the device, replay: one launch for the step

What makes a step capturable (else it runs eager, and ``auto`` says why once):

    CUDA, one process, placement=sharded with the native backend on the Triton
    kernels (tables of any dtypes, several too: embeddings/dtype_stacks.py routes
    them on the device; half optimizer state too), fused sparse updates (no
    accumulation), a dense optimizer that reads
    its lr from a tensor (SGD, Adam; Adagrad fused, where torch has its CUDA kernel:
    dlrm/train/optim.py), and the same shapes as the captured batch:
    B samples and N ids (single-hot data always; multi-hot when N repeats) —
    another shape (an epoch's short last batch, a batch that ``data.on_error=skip``
    dropped rows from) runs that step eager. The capture waits for a batch of the
    run's batch size, so a short one at step WARMUP does not become the shape every
    later step must have.

The sparse lr is a device tensor the update kernel reads (``set_lr`` fills it) and
the dense optimizer's lr is a device tensor too, filled before each replay: a
schedule changes both without a recapture. The loss of the replay is a static
tensor the meter reads afterwards, as it reads an eager step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from data.batch import Batch
from data.jagged import JaggedFeatures
from data.pinned import capturing

WARMUP = 3  # eager steps before the capture


def why_not(cfg: Any, device: torch.device, world_size: int) -> str | None:
    """Why this run's steps cannot be captured (None: they can, given static shapes)."""
    reasons = [
        (device.type != "cuda", "no CUDA device"),
        (world_size > 1, "more than one process (the all-to-alls and DDP run eager)"),
        (cfg.embeddings.placement != "sharded", "placement=hotline (host-side cold rows)"),
        (cfg.embeddings.backend != "native", f"embeddings.backend={cfg.embeddings.backend}"),
        (cfg.embeddings.kernels == "torch", "embeddings.kernels=torch (its backward syncs)"),
        (not cfg.embeddings.fused or cfg.train.accumulate != 1, "unfused sparse updates"),
        (cfg.train.profile_steps > 0 and cfg.train.profile_mode == "torch",
         "train.profile_steps (profiled steps run eager; train.profile_mode=python keeps them)"),
    ]
    return next((why for broken, why in reasons if broken), None)


class GraphedStep:
    """The captured step and its static buffers (see the module docstring)."""

    def __init__(self, body: Callable[[Batch], torch.Tensor], dense_opt: torch.optim.Optimizer,
                 say: Callable[[str], None], required: bool, batch_size: int) -> None:
        """``body(batch)``: forward, backward, dense update of one batch; returns the
        (unscaled) summed loss. ``required`` (cuda_graphs=on): a capture failure raises.
        ``batch_size``: the run's; the capture waits for a batch of that size."""
        self.body, self.dense_opt, self.say, self.required = body, dense_opt, say, required
        self.batch_size = batch_size
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Batch | None = None
        self.loss: torch.Tensor | None = None
        self.failed: str | None = None
        self.replays = self.eager_after_capture = 0
        self.captured_at: int | None = None
        self.timer = ReplayTimer()
        tensor_lrs(dense_opt)

    def fits(self, batch: Batch) -> bool:
        """Whether ``batch`` has the captured shapes (B samples, N ids, same keys)."""
        s = self.static
        return (s is not None and batch.size == s.size and batch.sparse.keys() == s.sparse.keys()
                and batch.sparse.values().numel() == s.sparse.values().numel()
                and tuple(batch.dense.shape) == tuple(s.dense.shape))

    def can_capture(self, batch: Batch) -> bool:
        """Whether to capture on ``batch``: none captured or failed yet, and it has the
        run's batch size (not an epoch's short last batch, nor one with dropped rows)."""
        return self.graph is None and self.failed is None and batch.size == self.batch_size

    def try_capture(self, batch: Batch, step: int) -> torch.Tensor | None:
        """Capture the step on ``batch`` (already on the device) and replay it once;
        its loss, or None where capture failed (``auto``: the run goes on eager)."""
        self.static = _static_copy(batch)
        try:
            graph, self.loss = capture(self.body, self.static, self.dense_opt)
        except Exception as e:  # a capture error is a RuntimeError of any kind
            if self.required:
                raise
            self.failed = f"capture failed at step {step}: {str(e).splitlines()[0][:200]}"
            self.say(f"warning: train.cuda_graphs=auto: {self.failed}; training eager")
            self.static = self.graph = None
            torch.cuda.synchronize()
            return None
        self.graph, self.captured_at = graph, step
        graph.replay()
        return self.loss

    def replay(self, batch: Batch) -> torch.Tensor:
        assert self.graph is not None and self.static is not None and self.loss is not None
        _copy_into(self.static, batch)
        self.timer.replay(self.graph)
        self.replays += 1
        return self.loss

    def summary(self) -> str:
        if self.failed:
            return f"eager ({self.failed})"
        if self.graph is None:
            return "eager (not captured)"
        return (f"graphs: captured at step {self.captured_at}, replayed {self.replays + 1} steps, "
                f"{self.eager_after_capture} other-shape steps eager{self.timer.summary()}")


class ReplayTimer:
    """The GPU time of a graph's replays: CUDA events recorded around each on the
    current stream, no host wait in the step (a pair is read once it has finished, at
    every 64th replay and at ``summary``). Beside the step's wall time it tells a
    device-bound step (replays fill it) from a host-bound one (the GPU idles between
    replays): the 2026-11-27 H200's captured Hotline step took 3.5 ms a step against
    native's 1.5, and nothing said which."""

    FOLD_EVERY = 64

    def __init__(self, enabled: bool | None = None) -> None:
        """``enabled``: time the replays (default: where CUDA is; the CPU tests' stand-in
        graphs replay untimed)."""
        self.enabled = torch.cuda.is_available() if enabled is None else enabled
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.ms, self.timed = 0.0, 0

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        if not self.enabled:
            graph.replay()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        self.pending.append((start, end))
        if len(self.pending) >= self.FOLD_EVERY:
            self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        """Add the finished pairs (all of them, waiting, when ``wait``); they finish in order."""
        done = 0
        for start, end in self.pending:
            if not wait and not end.query():
                break
            end.synchronize()
            self.ms += start.elapsed_time(end)
            done += 1
        self.timed += done
        del self.pending[:done]

    def summary(self) -> str:
        """", X ms of GPU time a replay" ("" where none was timed)."""
        self._fold(wait=True)
        return f", {self.ms / self.timed:.2f} ms of GPU time a replay" if self.timed else ""


def capture(body: Callable[[Batch], torch.Tensor], static: Batch, dense_opt: torch.optim.Optimizer
            ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``body(static)`` captured (not run): the graph and its static loss. The dense
    gradients are unset first, so the backward makes them in the graph's memory, where
    each replay writes them anew. ``thread_local``: other threads (the reader's pinning,
    Hotline's gather and host update) call CUDA while this one captures."""
    dense_opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with capturing(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        loss = body(static)
    return graph, loss


# the value each tensor lr was last filled with (set_lrs): a step that keeps the lr
# (most do) launches no fill. Keyed by identity: a WeakKeyDictionary's lookup compares
# its new weak reference with the stored one by == of their tensors, and bool() of
# that is a host read of the device before every step
_FILLED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def set_lrs(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every param group's lr: a device-side fill where it is a tensor (``tensor_lrs``:
    a replay reads it) and the lr changed since its last fill here, else the number."""
    for group in opt.param_groups:
        held = group["lr"]
        if not isinstance(held, torch.Tensor):
            group["lr"] = lr
        elif _FILLED.get(held) != lr:
            held.fill_(lr)
            _FILLED[held] = lr


def tensor_lrs(opt: torch.optim.Optimizer) -> None:
    """Each param group's lr as a device tensor (fused SGD, Adam and Adagrad read a tensor lr
    on the device), so a replay uses the lr of its step; and Adam's groups marked
    ``capturable`` (torch refuses to capture its step otherwise: the 2026-11-26 H200 run
    of the graph test). Set here, after a resume loaded the groups, so a checkpoint
    of an eager run resumes graphed."""
    for group in opt.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            device = group["params"][0].device
            group["lr"] = torch.tensor(float(group["lr"]), device=device)
        if "capturable" in group:  # Adam (SGD has no such flag: its step holds no counter)
            group["capturable"] = True


def _static_copy(batch: Batch) -> Batch:
    """Buffers of the batch's shapes, holding its values, that every replay reads."""
    sparse = batch.sparse
    static_sparse = JaggedFeatures(sparse.keys(), sparse.values().clone(), sparse.lengths().clone(),
                                   stride=sparse.stride())
    return Batch(batch.dense.clone(), static_sparse, batch.labels.clone())


def _copy_into(static: Batch, batch: Batch) -> None:
    static.dense.copy_(batch.dense, non_blocking=True)
    static.labels.copy_(batch.labels, non_blocking=True)
    static.sparse.values().copy_(batch.sparse.values(), non_blocking=True)
    static.sparse.lengths().copy_(batch.sparse.lengths(), non_blocking=True)
