"""An audit of a step's torch ops: no data-dependent shapes, no host reads, a count.

    with SyncAudit() as audit:
        step()
    audit.violations   # ops that would make a CUDA step wait for the device
    audit.compute_ops  # ops issued, a Triton launch counted as one

Flagged: ops whose output shape depends on tensor values (nonzero, unique, masked
select, boolean-mask indexing, repeat_interleave without output_size) and reads of a
value by the host (``.item()``, ``int(t)``, ``bool(t)``: ``_local_scalar_dense``),
and copies between devices (but for ``non_blocking`` ones from or into page-locked
host memory: queued DMA, which the host does not wait for). On the CPU these cost nothing, which is why they are
audited by name: on CUDA each one is a wait for the GPU.

Under ``TRITON_INTERPRET=1`` a kernel launch runs as Python over numpy, issuing torch
ops of its own (copies in and out); the audit counts the launch as one op and looks
away from what the interpreter does inside it. On a GPU a compiled launch issues no
torch op: the audit counts it by its ``JITFunction.run``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DATA_DEPENDENT = {"aten.nonzero", "aten.unique_consecutive", "aten._unique2", "aten._unique",
                  "aten.unique_dim", "aten.masked_select", "aten._local_scalar_dense",
                  "aten.nonzero_static"}
# Views, metadata and allocations: no kernel is launched for them.
FREE = {"aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.expand", "aten.t",
        "aten.transpose", "aten.unsqueeze", "aten.squeeze", "aten.detach", "aten.alias",
        "aten.empty", "aten.new_empty", "aten.as_strided", "aten.reshape", "aten.lift_fresh",
        "aten.permute", "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.empty_strided",
        "aten.new_empty_strided", "aten._reshape_alias",
        # torch.profiler.record_function's named spans (the trainer's micro-batch names)
        "profiler._record_function_enter_new", "profiler._record_function_exit"}


class SyncAudit(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.violations: list[str] = []
        self._unpatch: Any = None
        self._in_kernel = False

    def __enter__(self) -> Self:
        self._patch_triton_launches()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._unpatch is not None:
            self._unpatch()

    @property
    def compute_ops(self) -> int:
        """Ops that launch work: views, allocations and profiler marks left out."""
        return sum(n for name, n in self.ops.items()
                   if name not in FREE and not name.startswith("profiler."))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_kernel:  # the interpreter's own copies, inside one launch
            return func(*args, **kwargs)
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in DATA_DEPENDENT:
            self.violations.append(name)
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            self.violations.append("repeat_interleave without output_size")
        elif name in ("aten.index", "aten.index_put_", "aten.index_put") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        ):
            self.violations.append(f"{name} with a boolean mask")
        elif name in ("aten._to_copy", "aten.copy_") and _crosses_devices(name, args, kwargs):
            self.violations.append(f"{name} across devices")
        return func(*args, **kwargs)

    def _patch_triton_launches(self) -> None:
        """Count each Triton launch as one op: in the interpreter (whose own torch ops
        inside the launch are looked away from) and on a real GPU, where a launch
        issues no torch op at all (the 2026-11-26 H200 run of the stacks' audit test
        counted 0 launches)."""
        try:
            from triton.runtime import interpreter, jit
        except ImportError:
            return
        audit = self
        original_interpreted = interpreter.GridExecutor.__call__
        original_compiled = jit.JITFunction.run

        def interpreted(executor: Any, *args: Any, **kwargs: Any) -> Any:
            audit.ops[f"triton.{executor.fn.__name__}"] += 1
            audit._in_kernel = True
            try:
                return original_interpreted(executor, *args, **kwargs)
            finally:
                audit._in_kernel = False

        def compiled(function: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("warmup"):
                audit.ops[f"triton.{function.fn.__name__}"] += 1
            return original_compiled(function, *args, **kwargs)

        interpreter.GridExecutor.__call__ = interpreted
        jit.JITFunction.run = compiled

        def unpatch() -> None:
            interpreter.GridExecutor.__call__ = original_interpreted
            jit.JITFunction.run = original_compiled

        self._unpatch = unpatch


def _crosses_devices(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy between devices the host waits for: a ``non_blocking`` copy whose host
    side is page-locked is a DMA queued on a stream, not a wait, and is not flagged."""
    source = args[0] if name == "aten._to_copy" else args[1]
    target = kwargs.get("device") if name == "aten._to_copy" else args[0].device
    crosses = target is not None and isinstance(source, torch.Tensor) and torch.device(target) != source.device
    return crosses and not _queued_dma(name, args, kwargs)


def _queued_dma(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "aten.copy_":
        destination, source = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        host = destination if destination.device.type == "cpu" else source
    else:  # _to_copy to the device (to the host it makes a pageable tensor: a wait)
        source, non_blocking = args[0], kwargs.get("non_blocking", False)
        if source.device.type != "cpu":
            return False
        host = source
    return bool(non_blocking) and host.device.type == "cpu" and host.is_pinned()
