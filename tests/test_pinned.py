"""data/pinned.py: tensors copied into one block, each a view of it, equal to the
tensors themselves (pinned or not: the layout and copies are the same; CUDA runs pin)."""

from __future__ import annotations

import pytest
import torch

from data.batch import Batch
from data.jagged import JaggedFeatures
from data.pinned import pinned_copies


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(37, 13, generator=g), torch.rand(37, generator=g),
            torch.randint(0, 1 << 40, (101,), generator=g), torch.randint(0, 9, (74,), generator=g).int(),
            torch.randn(5, 3, generator=g).to(torch.bfloat16), torch.empty(0, 13), torch.tensor(True)]


def test_copies_equal_the_tensors_in_one_block() -> None:
    tensors = _tensors()
    copies = pinned_copies(tensors, pin=False)
    storage = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storage) == 1  # one block
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        if t.numel():  # (an empty tensor has no address)
            assert c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr()
    tensors[0].zero_()  # copies, not views of the sources
    assert not torch.equal(copies[0], tensors[0])


def test_a_tensor_not_contiguous_is_copied_apart() -> None:
    wide = torch.arange(40.0).view(4, 10)
    part, whole = wide[:, :3], torch.arange(6)
    copies = pinned_copies([part, whole], pin=False)
    assert torch.equal(copies[0], part) and torch.equal(copies[1], whole)
    assert copies[0].untyped_storage().data_ptr() != copies[1].untyped_storage().data_ptr()


def test_no_tensors() -> None:
    assert pinned_copies([], pin=False) == []


@pytest.mark.gpu  # page-locked memory needs CUDA
def test_batch_pin_memory_is_pinned_and_equal() -> None:
    tensors = _tensors()
    sparse = JaggedFeatures(["a", "b"], tensors[2], torch.full((74,), 1), 37)
    sparse.offsets()  # cached: pinned too
    batch = Batch(tensors[0], sparse, tensors[1])
    pinned = batch.pin_memory()
    for t, p in ((batch.dense, pinned.dense), (batch.labels, pinned.labels),
                 (sparse.values(), pinned.sparse.values()), (sparse.offsets(), pinned.sparse.offsets())):
        assert p.is_pinned() and torch.equal(p, t)
    again = pinned.pin_memory()  # pinned already: the same tensors, as torch's pin_memory()
    assert again.dense is pinned.dense and again.sparse.values() is pinned.sparse.values()


def test_nothing_to_copy_allocates_no_block(monkeypatch) -> None:
    """Tensors kept as they are (pinned already: here, as a CPU build cannot pin, the
    non-contiguous one copied apart) make no block: an empty pinned one cost ~68 us."""
    made = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real(*a, **k))
    wide = torch.arange(40.0).view(4, 10)
    (copy,) = pinned_copies([wide[:, :3]], pin=False)
    assert torch.equal(copy, wide[:, :3]) and made == []
