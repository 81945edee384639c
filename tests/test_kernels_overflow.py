"""The fp16 overflow warning on the Triton path (embeddings/narrow.py's line).

The torch path reads its update's overflow at once (a host read per step); the fused
Triton update counts, per feature, the finite values it rounded to inf in a device
buffer, read only by ``warn_fp16_overflow`` (the trainer calls it where it waits for
the device anyway). References: the torch path's line on the same tables and batches,
and the infs that appeared in the weight.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from data.jagged import JaggedFeatures
from embeddings import narrow
from embeddings.collection import LocalEmbeddingCollection, warn_fp16_overflow
from embeddings.dtype_stacks import DtypeStacks
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec


def tables(dtype: str = "fp16") -> list[TableSpec]:
    return [TableSpec("a", 50, 8, ("f0",), dtype=dtype), TableSpec("b", 30, 8, ("f1", "f2"), dtype=dtype)]


def pushed_up(kernels: str, start: float, lr: float, tabs: list[TableSpec] | None = None) -> LocalEmbeddingCollection:
    """A collection whose table b row 3 starts at ``start``, after one SGD step of
    ``lr`` that pushes that row up (f1's single lookup of it, gradient -1 per element)."""
    coll = LocalEmbeddingCollection(tabs or tables(), make_sparse_optimizer("sgd"), seed=3, device=DEVICE,
                                    kernels=kernels, rounding_seed=5)
    with torch.no_grad():
        coll.weight[50 + 3] = start
    sparse = JaggedFeatures(["f0", "f1", "f2"], torch.tensor([3]), torch.tensor([0, 1, 0])).to(DEVICE)
    coll.set_lr(lr)
    (coll(sparse) * -1.0).sum().backward()
    coll.step()
    return coll


def warnings_of(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_triton_path_warns_once_with_the_torch_paths_line(capsys: pytest.CaptureFixture[str]) -> None:
    narrow._said.clear()
    pushed_up("torch", 65000.0, 1000.0)  # the torch path warns inside the update
    want = warnings_of(capsys)
    assert len(want) == 1 and want[0].startswith("warning: table b: 8 values overflow fp16"), want
    narrow._said.clear()  # the same text again: warn_once would hide it
    coll = pushed_up("triton", 65000.0, 1000.0)
    assert coll.on_triton() and warnings_of(capsys) == []  # the step itself reads nothing
    assert torch.isinf(coll.weight[50 + 3]).all()
    warn_fp16_overflow(coll)
    assert warnings_of(capsys) == want
    # more overflow later (table b again, through its other feature): not said twice
    sparse = JaggedFeatures(["f0", "f1", "f2"], torch.tensor([4]), torch.tensor([0, 0, 1])).to(DEVICE)
    with torch.no_grad():
        coll.weight[50 + 4] = 65000.0
    (coll(sparse) * -1.0).sum().backward()
    warn_fp16_overflow(coll)
    assert warnings_of(capsys) == []
    assert int(coll.overflow_counts.sum()) == 16 and int(coll.overflow_counts[2]) == 8  # f2's row


def test_count_is_the_values_the_rounding_made_inf(capsys: pytest.CaptureFixture[str]) -> None:
    """Values just past 65504 round stochastically to 65504 or to inf: the kernel counts
    exactly those that became inf (reference: the weight's new infs)."""
    narrow._said.clear()
    coll = LocalEmbeddingCollection(tables(), make_sparse_optimizer("sgd"), seed=3, device=DEVICE,
                                    kernels="triton", rounding_seed=5)
    rows = torch.arange(10, 30)
    with torch.no_grad():
        coll.weight[50 + rows] = 65504.0
    step = torch.linspace(1.0, 31.0, 8, device=DEVICE)  # 65505..65535: P(inf) from 1/32 to 31/32
    lengths = torch.cat([torch.zeros(20), torch.ones(20), torch.zeros(20)]).long()  # f1: one row a sample
    sparse = JaggedFeatures(["f0", "f1", "f2"], rows, lengths, stride=20).to(DEVICE)
    upstream = torch.zeros(20, 24, device=DEVICE)
    upstream[:, 8:16] = -step
    coll.set_lr(1.0)
    (coll(sparse) * upstream).sum().backward()
    made_inf = int(torch.isinf(coll.weight[50 + rows]).sum())
    assert 0 < made_inf < 160  # some rounded up, some down
    assert int(coll.overflow_counts[1]) == made_inf and int(coll.overflow_counts.sum()) == made_inf
    warn_fp16_overflow(coll)
    assert warnings_of(capsys) == [f"warning: {narrow.fp16_overflow_line('b', made_inf)}"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_no_overflow_no_warning(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A step that stays in range (65000 + 1 x 8), and a bf16 table past fp16's range: quiet."""
    narrow._said.clear()
    coll = pushed_up("triton", 65000.0 if dtype == "fp16" else 1e6, 1.0, tables(dtype))
    warn_fp16_overflow(coll)
    assert warnings_of(capsys) == []
    assert int(coll.overflow_counts.sum()) == 0
    assert torch.isfinite(coll.weight).all()


def test_dtype_stacks_warn_for_their_fp16_stack(capsys: pytest.CaptureFixture[str]) -> None:
    """Tables of several dtypes on the Triton path: each stack takes the whole batch;
    the fp16 stack counts in its routed counter (the batch's feature order) and the
    line names its table; the torch path (split by stack) says the same line."""
    specs = [TableSpec("a", 50, 8, ("f0",), dtype="bf16"), TableSpec("b", 30, 8, ("f1", "f2"), dtype="fp16")]
    lines = {}
    for kernels in ("torch", "triton"):
        narrow._said.clear()
        made = DtypeStacks(specs, lambda: make_sparse_optimizer("sgd"), seed=3, device=DEVICE,
                           rounding_seed=5, kernels=kernels)
        fp16 = made.stacks[1]
        with torch.no_grad():
            fp16.weight[3] = 65000.0
        sparse = JaggedFeatures(["f0", "f1", "f2"], torch.tensor([7, 3]), torch.tensor([1, 1, 0])).to(DEVICE)
        made.set_lr(1000.0)
        (made(sparse) * -1.0).sum().backward()
        made.step()
        warn_fp16_overflow(made)
        lines[kernels] = warnings_of(capsys)
    assert made.on_triton()
    assert len(lines["torch"]) == 1 and lines["torch"][0].startswith("warning: table b: 8 values"), lines
    assert lines["triton"] == lines["torch"]


def hot_pushed_up(kernels: str, start: float, lr: float):
    """A Hotline collection (every row hot) whose table b row 3 starts at ``start``, after
    one fused SGD step of ``lr`` that pushes that row up (f1's lookup of it)."""
    from embeddings.hotline.mixed import hotline_collection
    from embeddings.hotline.profile import HotProfile

    tabs = tables()
    profile = HotProfile({t.name: torch.arange(t.rows) for t in tabs}, {f: t.name for t in tabs for f in t.features},
                         budget_bytes=0)
    coll = hotline_collection(tabs, profile, make_sparse_optimizer("sgd"), fused=True, seed=3, device=DEVICE,
                              kernels=kernels, rounding_seed=5)
    slot = int(torch.searchsorted(coll.hot.ids.cpu(), torch.tensor(50 + 3)))
    with torch.no_grad():
        coll.hot.weight[slot] = start
    coll.set_lr(lr)
    sparse = JaggedFeatures(["f0", "f1", "f2"], torch.tensor([3]), torch.tensor([0, 1, 0])).to(DEVICE)
    (coll(sparse) * -1.0).sum().backward()
    return coll, slot


def test_hotline_hot_tier_warns_on_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    """fp16 hot rows: the torch hot tier counts at its update, the Triton one on the
    device; either says the collection's line for table b when asked, once."""
    lines = {}
    for kernels in ("torch", "triton"):
        narrow._said.clear()
        coll, slot = hot_pushed_up(kernels, 65000.0, 1000.0)
        assert coll.hot.on_triton() == (kernels == "triton")
        assert torch.isinf(coll.hot.weight[slot]).all()
        assert warnings_of(capsys) == []  # nothing said at the update itself
        warn_fp16_overflow(coll)
        lines[kernels] = warnings_of(capsys)
        warn_fp16_overflow(coll)
        assert warnings_of(capsys) == []  # once
    assert lines["torch"] == lines["triton"]
    assert len(lines["triton"]) == 1 and lines["triton"][0].startswith("warning: table b: 8 values overflow fp16")
    narrow._said.clear()
    coll, _ = hot_pushed_up("triton", 60000.0, 1.0)  # no overflow: nothing to say
    warn_fp16_overflow(coll)
    assert warnings_of(capsys) == []
