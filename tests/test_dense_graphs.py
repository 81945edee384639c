"""hotline.graph_dense (dlrm/train/dense_graphs.py): the dense arch's halves replayed.

CUDA graphs need a GPU (tests/test_gpu.py trains Hotline with them against the eager
step). Here a stand-in graph, whose replay runs the captured function's forward or
backward eagerly on the static buffers, checks everything around the capture: the
inputs copied into the static buffers (and the bottom's output used in place as the
head's input), the gradients routed from the backward graphs to the parameters, the
pooled input and the bottom, the short batch and evaluation taking the eager
modules. Reference: the same DenseArch run eager, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dlrm.config import ModelConfig
from dlrm.models.dlrm import DenseArch
from dlrm.train.dense_graphs import DenseGraphs, GraphedPart, why_not
from tests.graph_stand_in import StandInGraph, stand_in_capture

BATCH, DENSE, FEATURES, DIM = 8, 5, 3, 4


def bodies(part: GraphedPart) -> None:
    """What the captured graphs do, eagerly: the forward writes the static output; the
    backward writes the static gradients of the static output's gradient."""
    grad_of = [x for x, g in zip(part.static_in, part.needs_grad) if g] + part.params

    def forward() -> None:
        with torch.no_grad():
            part.static_out.detach().copy_(part.fn(*part.static_in))

    def backward() -> None:
        with torch.enable_grad():
            out = part.fn(*part.static_in)
            for static, grad in zip(part.static_grads, torch.autograd.grad(out, grad_of, part.static_grad_out)):
                static.copy_(grad)

    part.fwd.body, part.bwd.body = forward, backward


def arch_pair(interaction: str, autocast: torch.dtype | None = None) -> tuple[DenseArch, DenseArch]:
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=DIM, bottom_mlp=[6, DIM], top_mlp=[5, 1], interaction=interaction)
    eager = DenseArch(DENSE, FEATURES, DIM, cfg)
    graphed = copy.deepcopy(eager)
    graphed.graphs = DenseGraphs(graphed, BATCH, DENSE, FEATURES * DIM, torch.device("cpu"),
                                 graph=StandInGraph, capture=stand_in_capture, autocast=autocast)
    for part in (graphed.graphs.bottom, graphed.graphs.head):
        bodies(part)
    return eager, graphed


def step(arch: DenseArch, dense: torch.Tensor, pooled: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    """Forward (the pooled input a function, as the model passes it; under bf16
    autocast where asked, as the trainer runs it), loss, backward, an SGD update; the
    pooled input's gradient."""
    pooled = pooled.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = arch(dense, lambda: pooled).float()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.rand(logits.shape[0],
                                                                generator=torch.Generator().manual_seed(1)))
    loss.backward()
    with torch.no_grad():
        for p in arch.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return pooled.grad


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_graphed_halves_train_as_the_eager_arch(interaction: str) -> None:
    eager, graphed = arch_pair(interaction)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        dense, pooled = torch.randn(BATCH, DENSE, generator=g), torch.randn(BATCH, FEATURES * DIM, generator=g)
        assert torch.equal(step(graphed, dense, pooled), step(eager, dense, pooled))
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name
    parts = graphed.graphs.bottom, graphed.graphs.head
    assert [(p.fwd.replays, p.bwd.replays) for p in parts] == [(3, 3), (3, 3)]
    assert "graphs" not in dict(graphed.named_modules()) and graphed.state_dict().keys() == eager.state_dict().keys()


def test_graphed_halves_under_bf16_autocast_train_as_the_eager_arch() -> None:
    """train.precision=bf16: each half captured under autocast (the cast cache off), so
    its replays make the eager arch's bf16 products under the trainer's autocast, bit
    for bit; without it the graphs would replay fp32 products and differ."""
    eager, graphed = arch_pair("dot", autocast=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        dense, pooled = torch.randn(BATCH, DENSE, generator=g), torch.randn(BATCH, FEATURES * DIM, generator=g)
        assert torch.equal(step(graphed, dense, pooled, True), step(eager, dense, pooled, True))
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name
    assert graphed.graphs.bottom.static_out.dtype == torch.bfloat16  # the bottom's products were bf16


def test_another_batch_size_and_evaluation_run_eager() -> None:
    eager, graphed = arch_pair("dot")
    g = torch.Generator().manual_seed(3)
    short = torch.randn(BATCH - 3, DENSE, generator=g), torch.randn(BATCH - 3, FEATURES * DIM, generator=g)
    assert torch.equal(step(graphed, *short), step(eager, *short))
    graphed.eval()
    eager.eval()
    full = torch.randn(BATCH, DENSE, generator=g), torch.randn(BATCH, FEATURES * DIM, generator=g)
    with torch.no_grad():
        assert torch.equal(graphed(*full), eager(*full))
    assert graphed.graphs.bottom.fwd.replays == 0 and graphed.graphs.head.fwd.replays == 0


def test_the_bottom_output_is_the_head_input_buffer() -> None:
    """The head reads the bottom graph's output where it is: no copy between them."""
    _, graphed = arch_pair("dot")
    bottom, head = graphed.graphs.bottom, graphed.graphs.head
    assert head.static_in[0].data_ptr() == bottom.static_out.data_ptr()


@pytest.mark.parametrize("asked", ["true", "auto"])
def test_a_cpu_run_says_why_not_only_when_graphs_are_asked_for(tiny_data, tmp_path, asked: str) -> None:
    """hotline.graph_dense / graph_split on a CPU: ``true`` (YAML's boolean, read as on)
    says in one line each why they run eager; ``auto`` (the default) runs eager without
    a word. Either way nothing is graphed and the step mode says so."""
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import TINY, tiny_overrides

    said: list[str] = []
    cfg = load_config(TINY, tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": ""})
                      + ["train.max_steps=2", "embeddings.placement=hotline", "hotline.budget=1MB",
                         f"hotline.graph_dense={asked}", f"hotline.graph_split={asked}"])
    summary = train(cfg, tmp_path / "run", echo=said.append)
    warned = [s for s in said if "hotline.graph_" in s]
    if asked == "true":
        assert cfg.hotline.graph_dense == cfg.hotline.graph_split == "on"
        assert len(warned) == 2, said
        assert sorted(warned) == ["warning: hotline.graph_dense=on: the dense model runs eager: no CUDA device",
                                  "warning: hotline.graph_split=on: splits run eager: no CUDA device"], said
    else:
        assert warned == [], said
    assert summary["hotline"]["split_graphed"] == 0.0
    assert "graphed" not in summary["step_mode"]


def test_where_the_dense_model_cannot_be_graphed() -> None:
    from dlrm.config import load_config
    from tests.conftest import TINY

    cuda = torch.device("cuda")
    assert why_not(load_config(TINY), torch.device("cpu"), 1) == "no CUDA device"
    assert why_not(load_config(TINY), cuda, 1) is None
    assert why_not(load_config(TINY), cuda, 2).startswith("more than one process")
    assert why_not(load_config(TINY, ["train.accumulate=2"]), cuda, 1).startswith("train.accumulate")
    assert why_not(load_config(TINY, ["train.precision=bf16"]), cuda, 1) is None  # captured under autocast


def test_auto_graphs_the_dense_model_where_it_can_and_trains_as_eager(tiny_data, tmp_path, monkeypatch) -> None:
    """hotline.graph_dense=auto (the default) where the dense model can be graphed
    (why_not None, as on one GPU; stand-in graphs here): the trainer captures it, every
    step replays it, the step mode says so, and the run ends equal, bit for bit, to the
    same run with graph_dense=off (every parameter and optimizer state)."""
    from dlrm.train import trainer as trainer_module
    from tests import gpu_cases as cases
    from tests.run_state import run_state

    made: list[DenseGraphs] = []

    def stand_in(arch, *args, **kwargs) -> DenseGraphs:
        made.append(DenseGraphs(arch, *args, **kwargs, graph=StandInGraph, capture=stand_in_capture))
        for part in (made[-1].bottom, made[-1].head):
            bodies(part)
        return made[-1]

    base = (*cases.HOTLINE, "hotline.graph_split=off")
    eager = cases.run(tiny_data, tmp_path / "off", "cpu", *base, "hotline.graph_dense=off", steps=6)
    monkeypatch.setattr(trainer_module, "dense_graphs_why_not", lambda *a: None)
    monkeypatch.setattr(trainer_module, "DenseGraphs", stand_in)
    graphed = cases.run(tiny_data, tmp_path / "auto", "cpu", *base, steps=6)
    assert "dense model graphed (hotline.graph_dense)" in graphed["step_mode"], graphed["step_mode"]
    assert "graphed" not in eager["step_mode"]
    assert len(made) == 1 and made[0].bottom.fwd.replays == made[0].head.bwd.replays == 6
    got, want = run_state(tmp_path / "auto"), run_state(tmp_path / "off")
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
