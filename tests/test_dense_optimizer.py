"""The dense optimizer (dlrm/train/optim.py): which implementation a device takes,
whether a CUDA graph can hold its step, and a resume that keeps this process's
implementation whatever the checkpoint's was (tests/test_gpu.py: on CUDA, a graph of
each dense optimizer replays as eager training runs)."""

from __future__ import annotations

import copy

import pytest
import torch

from dlrm.config import load_config
from dlrm.train import optim
from dlrm.train.adagrad import DeviceAdagrad
from dlrm.train.graphs import why_not
from dlrm.train.optim import build_dense_optimizer, fused_adagrad_runs, load_dense_state
from dlrm.train.sync_audit import SyncAudit
from tests.conftest import TINY


def test_the_probe_finds_the_fused_adagrad_this_torch_has() -> None:
    """torch's fused CPU Adagrad takes a tensor lr; without CUDA the probe says no (with
    CUDA it says what this torch has: tests/test_gpu.py reads it)."""
    assert fused_adagrad_runs(torch.device("cpu")) is True
    if not torch.cuda.is_available():
        assert fused_adagrad_runs(torch.device("cuda")) is False


@pytest.mark.parametrize("fused", [True, False])
def test_dense_adagrad_is_captured_whether_torch_fuses_it_or_not(monkeypatch, fused: bool) -> None:
    """The default dense optimizer (adagrad) rules out no CUDA graph: torch's fused CUDA
    kernel where this torch has it, else dlrm/train/adagrad.py (which reads nothing on
    the host)."""
    monkeypatch.setattr(optim, "fused_adagrad_runs", lambda device: fused)
    cfg = load_config(TINY, ["embeddings.kernels=triton"])
    assert cfg.optim.dense == "adagrad"
    assert why_not(cfg, torch.device("cuda"), 1) is None


def _grads(params: list[torch.nn.Parameter], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=generator) * (step + 1) for p in params]


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_device_adagrad_steps_as_torchs_adagrad_bit_for_bit(tensor_lr: bool) -> None:
    """dlrm/train/adagrad.py against torch's Adagrad (its multi-tensor path, lr_decay 0):
    the same bits, with the lr a number or a tensor (a captured step's); and a step
    that reads nothing on the host, where torch's reads each step count (.item())."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    theirs = [copy.deepcopy(p) for p in ours]
    mine = DeviceAdagrad(ours, lr=torch.tensor(0.05) if tensor_lr else 0.05, eps=1e-8)
    reference = torch.optim.Adagrad(theirs, lr=0.05, eps=1e-8, foreach=True)
    for step in range(5):
        for params, opt in ((ours, mine), (theirs, reference)):
            for p, g in zip(params, _grads(params, step), strict=True):
                p.grad = g
        with SyncAudit() as audit:
            mine.step()
        assert audit.violations == [], audit.violations
        with SyncAudit() as audit:
            reference.step()
        assert "aten._local_scalar_dense" in audit.violations  # why torch's cannot be captured
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(mine.state[a]["sum"], reference.state[b]["sum"])
        assert float(mine.state[a]["step"]) == float(reference.state[b]["step"]) == 5


@pytest.mark.parametrize("to_ours", [True, False])
def test_device_adagrad_and_torchs_resume_each_others_checkpoints(to_ours: bool) -> None:
    """A CPU run's checkpoint (torch's fused Adagrad) resumed on a CUDA torch without
    the fused kernel (ours), and back: the state comes over and the next steps equal
    those of the optimizer that wrote it."""
    cfg = load_config(TINY, ["optim.dense=adagrad"])
    def make_theirs(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(params, lr=0.1, eps=cfg.optim.eps, fused=True)

    def make_ours(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return DeviceAdagrad(params, lr=0.1, eps=cfg.optim.eps)

    write, read = (make_theirs, make_ours) if to_ours else (make_ours, make_theirs)
    torch.manual_seed(0)
    first = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    writer = _stepped(write, first)
    second = [copy.deepcopy(p) for p in first]
    reader = read(second)
    load_dense_state(reader, copy.deepcopy(writer.state_dict()))
    for step in range(3):
        for params, opt in ((first, writer), (second, reader)):
            for p, g in zip(params, _grads(params, step), strict=True):
                p.grad = g
            opt.step()
    for got, want in zip(second, first, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_device_adagrad_refuses_a_state_with_lr_decay() -> None:
    saved = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1, lr_decay=0.01).state_dict()
    with pytest.raises(ValueError, match="lr_decay or weight_decay"):
        DeviceAdagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1).load_state_dict(saved)


def _stepped(make, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    opt = make(params)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return opt


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_a_resume_keeps_this_processs_implementation(kind: str) -> None:
    """A checkpoint written by fused optimizers (a CUDA run's, its lr a tensor) loads
    into this CPU process's (fused for Adam and Adagrad; SGD torch's default): the
    implementation stays (torch's load alone made SGD fused, the lr a tensor) and the
    state comes over: the next step equals the fused optimizer's own next step."""
    cfg = load_config(TINY, [f"optim.dense={kind}"])
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, fused=True),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=cfg.optim.eps, fused=True),
            "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, eps=cfg.optim.eps, fused=True)}[kind]
    torch.manual_seed(0)
    theirs = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    there = _stepped(make, theirs)
    saved = copy.deepcopy(there.state_dict())
    saved["param_groups"][0]["lr"] = torch.tensor(0.1)  # a graphed run's lr is a tensor

    mine = [copy.deepcopy(p) for p in theirs]
    here = build_dense_optimizer(cfg, mine)
    flags = {k: here.param_groups[0].get(k) for k in ("fused", "foreach", "capturable")}
    load_dense_state(here, saved)
    assert {k: here.param_groups[0].get(k) for k in flags} == flags
    assert not isinstance(here.param_groups[0]["lr"], torch.Tensor)
    here.param_groups[0]["lr"] = 0.1  # as the trainer's schedule sets it each step
    for opt, params in ((there, theirs), (here, mine)):
        for p in params:
            p.grad = torch.full_like(p, -0.25)
        opt.step()
    for got, want in zip(mine, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_saved_state_of_other_groups_is_refused() -> None:
    cfg = load_config(TINY, ["optim.dense=sgd"])
    here = build_dense_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])
    two = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                           {"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=0.1)
    with pytest.raises(ValueError, match="2 dense parameter groups saved, 1 here"):
        load_dense_state(here, two.state_dict())


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_the_cpu_step_is_torchs_fused_one_where_it_pays(kind: str) -> None:
    """Adam and Adagrad fused on the CPU (one pass a parameter; bench.yaml's dense
    update 1.9 -> 0.8 ms a step with Adam), SGD torch's default; the steps equal torch's
    default loop's to rounding."""
    cfg = load_config(TINY, [f"optim.dense={kind}"])
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    plain = [copy.deepcopy(p) for p in ours]
    opt = build_dense_optimizer(cfg, ours)
    assert bool(opt.defaults.get("fused")) is (kind != "sgd")
    reference = type(opt)(plain, lr=opt.defaults["lr"], eps=opt.defaults.get("eps", 0.0)) if kind != "sgd" \
        else torch.optim.SGD(plain, lr=opt.defaults["lr"])
    for step in range(5):
        for a, b in zip(ours, plain, strict=True):
            a.grad = torch.randn_like(a) * (step + 1)
            b.grad = a.grad.clone()
        opt.step()
        reference.step()
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
