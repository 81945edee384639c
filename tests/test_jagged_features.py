"""``data.jagged.JaggedFeatures``: its layout, its KJT-named accessors, zero-copy
conversions to and from TorchRec's ``KeyedJaggedTensor``, and ``permute_bags``'s
torch fallback against fbgemm's op (the TorchRec parts skip where torchrec is absent)."""

from __future__ import annotations

import pytest
import torch

from data.jagged import JaggedFeatures
from embeddings import jagged


def picture() -> JaggedFeatures:
    """The module docstring's example: a = [x0 x1] [] [x2], b = [y0] [y1 y2] [y3]."""
    return JaggedFeatures(["a", "b"], torch.tensor([10, 11, 12, 20, 21, 22, 23]),
                          torch.tensor([2, 0, 1, 1, 2, 1]))


def bags(sparse: JaggedFeatures) -> dict[str, list[list[int]]]:
    return {k: [b.tolist() for b in jt.to_dense()] for k, jt in sparse.to_dict().items()}


def test_layout_and_accessors() -> None:
    s = picture()
    assert s.keys() == ["a", "b"] and s.stride() == 3
    assert s.offsets().tolist() == [0, 2, 2, 3, 4, 6, 7]
    assert s.length_per_key() == [3, 4]
    assert bags(s) == {"a": [[10, 11], [], [12]], "b": [[20], [21, 22], [23]]}
    assert s["b"].values().tolist() == [20, 21, 22, 23] and s["b"].lengths().tolist() == [1, 2, 1]
    assert s["a"].offsets().tolist() == [0, 2, 2, 3]
    with pytest.raises(ValueError, match="6 bags"):
        JaggedFeatures(["a", "b"], s.values(), s.lengths(), stride=4)
    empty = JaggedFeatures(["a", "b"], torch.zeros(0, dtype=torch.int64),
                           torch.zeros(0, dtype=torch.int64))
    assert empty.stride() == 0 and bags(empty) == {"a": [], "b": []}
    assert empty.offsets().tolist() == [0]


def test_select_and_cat() -> None:
    s = picture()
    part = s.select(torch.tensor([2, 0, 2]))
    assert part.stride() == 3
    assert bags(part) == {"a": [[12], [10, 11], [12]], "b": [[23], [20], [23]]}
    assert bags(s.select(torch.zeros(0, dtype=torch.int64))) == {"a": [], "b": []}
    both = JaggedFeatures.cat([s.select(torch.tensor([1])), s])
    assert both.stride() == 4
    assert bags(both) == {"a": [[], [10, 11], [], [12]], "b": [[21, 22], [20], [21, 22], [23]]}


def test_to_cpu_keeps_everything() -> None:
    s = picture()
    s.offsets()
    moved = s.to(torch.device("cpu"), non_blocking=True)
    assert moved.keys() == s.keys() and moved.stride() == 3
    assert torch.equal(moved.values(), s.values()) and torch.equal(moved.offsets(), s.offsets())


@pytest.mark.gpu
def test_to_cuda_pinned_and_back() -> None:
    s = picture()
    pinned = s.pin_memory()
    assert pinned.values().is_pinned() and pinned.lengths().is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_gpu = pinned.to("cuda", non_blocking=True)
    on_gpu.record_stream(torch.cuda.current_stream())
    torch.cuda.current_stream().wait_stream(stream)
    assert on_gpu.values().is_cuda and on_gpu.offsets().is_cuda
    assert bags(on_gpu.to("cpu")) == bags(s)


def test_kjt_round_trip_shares_the_tensors() -> None:
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    s = picture()
    kjt = s.to_kjt()
    assert isinstance(kjt, KeyedJaggedTensor)
    assert kjt.keys() == s.keys() and kjt.stride() == s.stride()
    assert kjt.values().data_ptr() == s.values().data_ptr()
    assert kjt.lengths().data_ptr() == s.lengths().data_ptr()
    assert torch.equal(kjt.offsets(), s.offsets()) and kjt.length_per_key() == s.length_per_key()
    for key, jt in kjt.to_dict().items():
        assert torch.equal(jt.values(), s[key].values())
        assert torch.equal(jt.lengths(), s[key].lengths())
    back = JaggedFeatures.from_kjt(kjt)
    assert back.values().data_ptr() == s.values().data_ptr() and bags(back) == bags(s)
    from_offsets = KeyedJaggedTensor(keys=["a", "b"], values=s.values(), offsets=s.offsets())
    assert bags(JaggedFeatures.from_kjt(from_offsets)) == bags(s)


def random_bags(seed: int, bags_: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (bags_,), generator=g)
    return lengths, torch.randint(0, 1000, (int(lengths.sum()),), generator=g)


@pytest.mark.parametrize(("bags_", "max_len"), [(0, 4), (1, 4), (7, 4), (300, 4), (300, 1), (50, 0)])
def test_permute_bags_fallback_equals_fbgemm(bags_: int, max_len: int, monkeypatch) -> None:
    """Random bags, some empty; all of one id (the single-hot shortcut); all empty."""
    pytest.importorskip("fbgemm_gpu")
    assert jagged._fbgemm_ops()
    lengths, values = random_bags(bags_, bags_, max_len)
    if max_len == 1:
        lengths = torch.ones_like(lengths)
        values = torch.randint(0, 1000, (bags_,))
        assert jagged._one_id_per_bag(lengths, values)
    order = torch.randperm(bags_, generator=torch.Generator().manual_seed(1))
    want = jagged.permute_bags(lengths, values, order)
    monkeypatch.setattr(jagged, "_fbgemm_ops", lambda: False)
    got = jagged.permute_bags(lengths, values, order)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_permute_bags_fallback_by_hand(monkeypatch) -> None:
    """The fallback (where fbgemm is not loaded): the docstring's example."""
    monkeypatch.setattr(jagged, "_fbgemm_ops", lambda: False)
    lengths, values = torch.tensor([2, 0, 1]), torch.tensor([10, 11, 12])
    new_lengths, new_values = jagged.permute_bags(lengths, values, torch.tensor([2, 0, 1]))
    assert new_lengths.tolist() == [1, 2, 0] and new_values.tolist() == [12, 10, 11]
