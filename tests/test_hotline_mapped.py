"""hotline.cold_path=mapped (embeddings/hotline/mapped.py): the host tier's tables read
in place by the device. The training runs that compare it with ordinary training are
in tests/test_hotline_graph.py (static steps, a write-back still running) and
tests/test_hotline_train.py (eager steps, refreshes); here the views themselves, and
what a run does where CUDA refuses the registration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embeddings.hotline import mapped
from embeddings.hotline.mapped import MappedTables
from tests.test_hotline_train import HOTLINE, run
from tests.test_shm_pinned import FakeCudart

CUDA = torch.cuda.is_available()


def test_on_the_cpu_the_view_is_the_table() -> None:
    table = torch.randn(100, 8)
    view = MappedTables(torch.device("cpu")).view(table)
    assert view is table


@pytest.mark.parametrize("taken,want", [
    ([], [(0, 100)]),
    ([(0, 100)], []),
    ([(20, 40)], [(0, 20), (40, 100)]),
    ([(60, 200), (-50, 10)], [(10, 60)]),
    ([(100, 200)], [(0, 100)]),  # adjacent: nothing shared
])
def test_gaps_are_the_pages_no_registration_covers(taken, want) -> None:
    assert mapped._gaps(0, 100, taken) == want


class _AliasOf:
    """What ``torch.as_tensor`` gives for a CUDA array interface on the pointer's own
    device, off a GPU: an alias."""

    def __init__(self, obj, device: torch.device) -> None:
        assert device == torch.device("cuda", 0)  # named: never a copy to the default device
        self.device = device
        self._pointer = obj.__cuda_array_interface__["data"][0]

    def data_ptr(self) -> int:
        return self._pointer


def test_storages_sharing_a_page_register_each_page_once(monkeypatch) -> None:
    """Two storages side by side in one page (small tensors from the heap): CUDA refuses a
    page registered twice, so the second registers only its pages not yet registered;
    close() waits for the device, then undoes each registration. A refusal names the
    bytes and CUDA's error."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.calls.append(("synchronize", device)))
    monkeypatch.setattr(mapped, "_device_pointer", lambda address: address)  # the same address (UVA)
    monkeypatch.setattr(torch, "as_tensor", _AliasOf)
    page, flags = 4096, 3  # portable | mapped
    tables = MappedTables(torch.device("cuda", 0))
    tables._map(10 * page + 16, 5000)  # pages 10, 11
    tables._map(10 * page + 16 + 5000, 3000)  # ends in page 11: nothing new
    tables._map(10 * page + 16 + 8000, 200)  # into page 12
    assert fake.calls == [("register", 10 * page, 2 * page, flags), ("register", 12 * page, page, flags)]
    assert tables.registered_bytes == 3 * page
    tables.close()
    assert fake.calls[2:] == [("synchronize", torch.device("cuda", 0)), ("unregister", 10 * page),
                              ("unregister", 12 * page)]
    assert tables.registered_bytes == 0
    fake.ok = False
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 8,192 bytes failed \(CUDA error 2\)"):
        tables._map(20 * page, 2 * page)


@pytest.mark.skipif(CUDA, reason="on a GPU test_the_device_reads_the_host_rows_in_place makes real views")
def test_the_view_is_made_by_a_call_that_takes_a_cuda_array_interface(monkeypatch) -> None:
    """Only CUDA faked, not torch: the view's call accepts the interface object and goes
    on to CUDA (on this CPU build it stops at CUDA's initialisation, the furthest a CPU
    can check). The call before (``torch.asarray(copy=False)``, faked by the test above)
    refuses any such object with a ValueError, whatever the build (torch reads the
    interface only where it may copy), so on a GPU every mapped run would have gathered
    on the host (the 2026-12-07 review)."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(mapped, "_device_pointer", lambda address: address)
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        MappedTables(torch.device("cuda", 0))._map(10 * 4096, 4096)
    assert fake.calls == [("register", 10 * 4096, 4096, 3)]


def test_tables_of_several_dtypes_all_read_one_way_where_one_is_refused(monkeypatch) -> None:
    """A collection per dtype group: where the second group's registration is refused,
    the first's is undone too (the run then gathers every group on the host, as its
    warning says; before, the first group went on reading in place, unregistered never)."""
    from embeddings.hotline.host_local import LocalHostTier
    from tests.test_hotline_ahead import _setup

    coll, _, _ = _setup(True)
    assert len(coll.groups) >= 2
    registered = LocalHostTier.read_in_place
    calls = []

    def second_refused(self, device):
        calls.append(device)
        if len(calls) == 2:
            raise RuntimeError("cudaHostRegister of 4,096 bytes failed (CUDA error 2)")
        registered(self, device)

    monkeypatch.setattr(LocalHostTier, "read_in_place", second_refused)
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        coll.read_in_place()
    assert len(calls) == 2 and not any(g.reads_in_place for g in coll.groups)


@pytest.mark.slow
def test_a_refused_registration_says_so_and_gathers_on_the_host(tiny_data, tmp_path: Path, monkeypatch) -> None:
    """Where CUDA will not register the tables (a memlock limit, no driver), the run
    says why in one warning line and trains with the host's gather, exactly."""
    from embeddings.hotline.host_local import LocalHostTier

    def refused(self, device):
        raise RuntimeError("cudaHostRegister of 1,048,576 bytes failed (CUDA error 2)\nmore")

    monkeypatch.setattr(LocalHostTier, "read_in_place", refused)
    lines: list[str] = []
    from dlrm.config import load_config
    from dlrm.train.trainer import train
    from tests.conftest import TINY, tiny_overrides
    from tests.run_state import assert_states_close, run_state

    overrides = tiny_overrides(**{"data.train": tiny_data["train"], "data.eval": ""})
    cfg = load_config(TINY, [*overrides, "train.max_steps=6", *HOTLINE, "hotline.cold_path=mapped"])
    summary = train(cfg, tmp_path / "hot", echo=lines.append)
    plain = run(tiny_data, tmp_path / "host", "train.max_steps=6", *HOTLINE)
    warned = [line for line in lines if "hotline.cold_path=mapped" in line]
    assert warned == [("warning: hotline.cold_path=mapped: cudaHostRegister of 1,048,576 bytes failed "
                       "(CUDA error 2); the cold rows are gathered on the host")], warned
    assert summary["hotline"]["cold_in_place"] == 0.0
    assert summary["hotline"]["hot_hit_rate"] == pytest.approx(plain["hotline"]["hot_hit_rate"], rel=1e-12)
    assert_states_close(run_state(tmp_path / "hot"), run_state(tmp_path / "host"), "refused", 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="registers host memory with CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_device_reads_the_host_rows_in_place(dtype: torch.dtype) -> None:
    """A table and a per-row state (a second storage), registered once each: the device
    view has the host's values and address space, a row the host writes afterwards is
    read as written (no copy was made), and a gather by the device equals the host's.
    Closed, the storages can be registered again (their registration was undone)."""
    device = torch.device("cuda", torch.cuda.current_device())
    table = torch.randn(5000, 64).to(dtype)
    state = torch.rand(5000)
    mapped = MappedTables(device)
    view, state_view = mapped.view(table), mapped.view(state)
    assert view.device == device and view.dtype == dtype and view.shape == table.shape
    assert torch.equal(view.cpu(), table) and torch.equal(state_view.cpu(), state)
    assert mapped.registered_bytes >= table.numel() * table.element_size() + state.numel() * 4
    before = mapped.registered_bytes
    assert mapped.view(table[10:20]).data_ptr() == view[10:20].data_ptr()  # the same registration
    assert mapped.registered_bytes == before
    table[7] = 3.0  # written on the host after the views were made
    ids = torch.tensor([7, 0, 4999, 7, 123], device=device)
    torch.cuda.synchronize()
    assert torch.equal(view.index_select(0, ids).cpu(), table.index_select(0, ids.cpu()))
    assert torch.equal(state_view.index_select(0, ids).cpu(), state.index_select(0, ids.cpu()))
    mapped.close()
    again = MappedTables(device)  # a storage still registered would be refused
    assert torch.equal(again.view(table).cpu(), table)
    again.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="hotline.cold_path=mapped on a GPU")
@pytest.mark.parametrize("graph_step", ["off", "on"])
def test_a_hotline_run_on_cuda_reads_its_cold_rows_in_place(tiny_data, tmp_path: Path, graph_step: str) -> None:
    """A Hotline run on the GPU with the tables read (eager steps) and also written (static
    steps, captured: their staged rows written back by the device) in place trains as
    the host's gather and store do, with the checkpoint's host tables read after the
    device's writes, and says it read them in place."""
    from tests.run_state import assert_states_close, run_state

    steps = ("train.max_steps=10", "optim.sparse=adam", "optim.dense=adam", f"hotline.graph_step={graph_step}",
             "embeddings.kernels=triton", "data.batch_size=32")
    run(tiny_data, tmp_path / "host", *steps, *HOTLINE)
    summary = run(tiny_data, tmp_path / "mapped", *steps, *HOTLINE, "hotline.cold_path=mapped")
    assert summary["hotline"]["cold_in_place"] == 1.0
    if graph_step == "on":
        assert summary["step_mode"].startswith("hotline step static"), summary["step_mode"]
    assert_states_close(run_state(tmp_path / "mapped"), run_state(tmp_path / "host"), "mapped on cuda", 1e-4)
