"""``hotline.graph_dense``: the dense model's two halves as CUDA graphs inside Hotline's eager step.

A Hotline step runs eager: its cold rows come from the host and its lookups' sizes
change every step, so the whole step cannot be captured as ``train.cuda_graphs``
captures the native one (dlrm/train/graphs.py). On a GPU an eager step is
host-bound (the first H200 figures: ~12 ms of op dispatch for ~1 ms of device work),
and the dense model is half of its ops. With one pass per mini-batch (Hotline's
step) the dense model sees the mini-batch's static shapes, so each half is captured
once and replayed:

    bottom   dense [B, n_dense] ──fwd graph──► [B, D]            (its input copied in)
    head     ([B, D], pooled [B, F*D]) ──fwd graph──► logits [B, 1]   (pooled copied in;
                                                  the bottom's output IS its input buffer)
    backward grad of logits ──bwd graph──► grads of [B, D], pooled, the head's
             parameters; ──bwd graph──► grads of the bottom's parameters

Between them the embedding lookup runs eager (``start`` before the bottom graph,
``finish`` before the head's), as does the loss. Each half is an autograd Function
whose forward and backward replay the captured graphs (the shape of torch's
``make_graphed_callables``, captured with ``capture_error_mode="thread_local"``:
Hotline's gather, host-update and reader threads keep calling CUDA while the main
thread captures, which the default global mode forbids).

The gradients the backward returns are the graphs' static buffers: the dense
optimizer must read them before the next replay, so one backward a step (no
``train.accumulate``). Another batch size (an epoch's short last batch)
and evaluation (``eval()``) run the modules eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from data.pinned import capturing

WARMUP_ITERS = 3  # eager runs on a side stream before the capture (cuBLAS workspaces)


def why_not(cfg: Any, device: torch.device, world_size: int) -> str | None:
    """Why this run's dense model cannot be graphed in a Hotline step (None: it can)."""
    reasons = [
        (device.type != "cuda", "no CUDA device"),
        (world_size > 1, "more than one process (DDP hooks the backward)"),
        (cfg.train.accumulate != 1, "train.accumulate > 1 (the graphs' gradient buffers hold one pass)"),
    ]
    return next((why for broken, why in reasons if broken), None)


class GraphedPart:
    """``fn(*inputs)`` (one tensor out) over ``params``, captured for the inputs' shapes:
    a forward and a backward graph, their static buffers (see the module docstring).

    ``static_in`` [i] is the buffer input i is copied into (``shared`` [i]: a tensor
    whose storage to use instead, as the head takes the bottom's output); inputs that
    ``needs_grad`` get gradients. ``graph``: the graph type (torch.cuda.CUDAGraph; a
    test's stand-in) and ``capture(graph)`` its capture context. ``autocast`` (bf16 or
    None): ``fn`` runs under it, at the warm-up and the capture alike (``under``).
    """

    def __init__(self, fn: Callable[..., torch.Tensor], params: list[nn.Parameter],
                 samples: list[torch.Tensor], needs_grad: list[bool],
                 shared: list[torch.Tensor | None] | None = None,
                 graph: Callable[[], Any] | None = None,
                 capture: Callable[[Any], Any] | None = None,
                 autocast: torch.dtype | None = None) -> None:
        fn = under(fn, samples[0].device.type, autocast)
        self.fn, self.params, self.needs_grad = fn, list(params), list(needs_grad)
        shared = shared or [None] * len(samples)
        self.static_in = [(s if s is not None else x.detach().clone()).requires_grad_(g)
                          for x, s, g in zip(samples, shared, needs_grad, strict=True)]
        graph = graph or torch.cuda.CUDAGraph
        capture = capture or _cuda_capture
        grad_of = [x for x, g in zip(self.static_in, self.needs_grad) if g] + self.params
        self._warm_up(grad_of)
        self.fwd = graph()
        with capture(self.fwd):
            self.static_out = fn(*self.static_in)
        self.static_grad_out = torch.zeros_like(self.static_out)
        self.bwd = graph()
        with capture(self.bwd):
            self.static_grads = torch.autograd.grad(self.static_out, grad_of, self.static_grad_out)

    def _warm_up(self, grad_of: list[torch.Tensor]) -> None:
        """A few eager runs, forward and backward, on a side stream (CUDA), as torch's
        ``make_graphed_callables`` does: lazily made handles and workspaces exist
        before the capture. Nothing here touches a parameter's ``.grad``."""
        side = torch.cuda.Stream() if self.static_in[0].is_cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(WARMUP_ITERS):
                out = self.fn(*self.static_in)
                torch.autograd.grad(out, grad_of, torch.ones_like(out))
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(self, *inputs, *self.params)


class _Replay(torch.autograd.Function):
    """Forward: inputs copied into the static buffers (not one that IS its buffer),
    the forward graph replayed. Backward: the output's gradient copied in, the
    backward graph replayed; the gradients are its static buffers."""

    @staticmethod
    def forward(ctx: Any, part: GraphedPart, *args: torch.Tensor) -> torch.Tensor:
        ctx.part = part
        for static, x in zip(part.static_in, args[:len(part.static_in)]):
            if x.data_ptr() != static.data_ptr():
                static.detach().copy_(x)
        part.fwd.replay()
        return part.static_out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        part = ctx.part
        part.static_grad_out.copy_(grad)
        part.bwd.replay()
        grads = iter(g.detach() for g in part.static_grads)
        inputs = [next(grads) if g else None for g in part.needs_grad]
        return (None, *inputs, *(next(grads) for _ in part.params))


class DenseGraphs:
    """The dense arch's bottom MLP and head (interaction, top MLP) captured for batch
    ``batch``; ``forward`` runs them where the batch has that size (a plain object,
    not a module: nothing of it goes into a state dict)."""

    def __init__(self, arch: nn.Module, batch: int, num_dense: int, pooled_width: int,
                 device: torch.device, graph: Callable[[], Any] | None = None,
                 capture: Callable[[Any], Any] | None = None, autocast: torch.dtype | None = None) -> None:
        """``autocast``: train.precision=bf16's dtype (None: fp32): each half captured
        under it, as the eager arch runs under the trainer's."""
        self.batch = batch
        dense = torch.randn(batch, num_dense, device=device)
        self.bottom = GraphedPart(arch.bottom, list(arch.bottom.parameters()), [dense], [False],
                                  graph=graph, capture=capture, autocast=autocast)
        pooled = torch.randn(batch, pooled_width, device=device)

        def head(bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
            return arch.top(arch.interaction(bottom, pooled))

        head_params = [*arch.interaction.parameters(), *arch.top.parameters()]
        self.head = GraphedPart(head, head_params, [self.bottom.static_out, pooled], [True, True],
                                shared=[self.bottom.static_out.detach(), None], graph=graph, capture=capture,
                                autocast=autocast)

    def fits(self, dense: torch.Tensor) -> bool:
        return dense.shape[0] == self.batch

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
        """Logits [B]: the bottom graph, the lookup finished (``pooled`` a function:
        after it, as the eager arch does), the head graph."""
        bottom = self.bottom(dense)
        if callable(pooled):
            pooled = pooled()
        return self.head(bottom, pooled).squeeze(1)


def under(fn: Callable[..., torch.Tensor], device_type: str, dtype: torch.dtype | None
          ) -> Callable[..., torch.Tensor]:
    """``fn`` run under autocast to ``dtype`` (None: ``fn`` itself). The cast cache is
    off, as torch's ``make_graphed_callables`` asks: a weight's bf16 copy cached at the
    capture would be freed when the autocast region ends, and each replay must make its
    own, inside the graph."""
    if dtype is None:
        return fn

    def cast(*inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            return fn(*inputs)

    return cast


@contextlib.contextmanager
def _cuda_capture(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
    with capturing(), torch.cuda.graph(graph, capture_error_mode="thread_local"):  # data/pinned.py
        yield
