"""The staged cold rows' patch and keep (embeddings/kernels/stage_rows.py) against their
torch references: the same rows and state, whatever the ids shared by the two steps,
their counts, the state's widths and the table type."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import DEVICE

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

from embeddings.kernels.stage_rows import keep_reference, keep_rows, patch_reference, patch_rows

CAPACITY, DIM = 12, 5


def buffers(seed: int, count: int, prev_count: int, states: str, dtype: torch.dtype,
            capacity: int = CAPACITY, dim: int = DIM) -> tuple:
    """(ids, count, prev_ids, prev_count, rows, prev_rows, state, prev_state): ids drawn
    from 0..2C-5 (so the two steps share some), ascending in their first ``count``, stale
    values past it (a buffer's leftovers); ``states``: "" | "row" | "row,element"."""
    gen = torch.Generator().manual_seed(seed)
    span = 2 * capacity - 4

    def ids(n: int) -> torch.Tensor:
        head = torch.randperm(span, generator=gen)[:n].sort().values
        return torch.cat([head, torch.randint(0, span, (capacity - n,), generator=gen)])

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    widths = [w for w in states.split(",") if w]
    state = [values(capacity) if w == "row" else values(capacity, dim) for w in widths]
    prev_state = [values(*t.shape) for t in state]
    tensors = (ids(count), torch.tensor([count]), ids(prev_count), torch.tensor([prev_count]),
               values(capacity, dim), values(capacity, dim))
    return (*(t.to(DEVICE) for t in tensors), [t.to(DEVICE) for t in state], [t.to(DEVICE) for t in prev_state])


def copies(args: tuple) -> tuple:
    return tuple([t.clone() for t in a] if isinstance(a, list) else a.clone() for a in args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("states", ["", "row", "row,element", "element,element"])
@pytest.mark.parametrize("count,prev_count,capacity", [(7, 9, CAPACITY), (12, 12, CAPACITY), (0, 5, CAPACITY),
                                                       (6, 0, CAPACITY), (37, 45, 50), (50, 17, 50)])
def test_patch_and_keep_equal_torch(count: int, prev_count: int, capacity: int, states: str,
                                    dtype: torch.dtype) -> None:
    """Capacity 50: several programs of ROWS (16) rows each, the last one part-filled."""
    check_patch_and_keep(count, prev_count, capacity, states, dtype, DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 100])
def test_patch_and_keep_of_wide_rows_equal_torch(dim: int, dtype: torch.dtype) -> None:
    """The widths runs use (64: bench_gpu; 100: a masked 128-wide tile), their own
    tiles and warps (compiled by tests/test_kernels_compile.py too)."""
    check_patch_and_keep(37, 45, 50, "row,element", dtype, dim)


def check_patch_and_keep(count: int, prev_count: int, capacity: int, states: str, dtype: torch.dtype,
                         dim: int) -> None:
    args = buffers(count + 10 * prev_count, count, prev_count, states, dtype, capacity, dim)
    runs = []  # both kernels run before anything is compared (tests/compile_only.py compiles both)
    for kernel, reference in ((patch_rows, patch_reference), (keep_rows, keep_reference)):
        got, want = copies(args), copies(args)
        kernel(*got)
        reference(*want)
        runs.append((kernel, got, want))
    for kernel, got, want in runs:
        _, _, prev_ids, prev_count_t, rows, prev_rows, state, prev_state = got
        _, _, w_prev_ids, w_prev_count, w_rows, w_prev_rows, w_state, w_prev_state = want
        if kernel is patch_rows:  # the staged rows: every one, past ``count`` untouched
            torch.testing.assert_close(rows, w_rows, rtol=0, atol=0)
            for a, b in zip(state, w_state, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:  # the kept rows: the first ``count`` (the kernel leaves the rest as they were)
            n = count
            assert torch.equal(prev_ids[:n], w_prev_ids[:n]) and int(prev_count_t) == int(w_prev_count) == count
            torch.testing.assert_close(prev_rows[:n], w_prev_rows[:n], rtol=0, atol=0)
            for a, b in zip(prev_state, w_prev_state, strict=True):
                torch.testing.assert_close(a[:n], b[:n], rtol=0, atol=0)


def test_the_patch_takes_the_shared_rows_only() -> None:
    """A hand-made case: ids 3 and 8 shared, 5 not; ids past the counts ignored."""
    ids = torch.tensor([3, 5, 8, 1, 1], device=DEVICE)  # count 3: the trailing 1s are leftovers
    prev_ids = torch.tensor([1, 3, 8, 9, 5], device=DEVICE)  # prev_count 4: the 5 is a leftover
    rows = torch.zeros(5, DIM, device=DEVICE)
    prev_rows = torch.arange(5, dtype=torch.float32, device=DEVICE).unsqueeze(1).expand(5, DIM).contiguous() + 1
    state, prev_state = [torch.zeros(5, device=DEVICE)], [torch.arange(5, dtype=torch.float32, device=DEVICE) + 10]
    patch_rows(ids, torch.tensor([3], device=DEVICE), prev_ids, torch.tensor([4], device=DEVICE), rows, prev_rows,
               state, prev_state)
    assert rows[:, 0].tolist() == [2.0, 0.0, 3.0, 0.0, 0.0]  # 3 from prev place 1, 8 from place 2
    assert state[0].tolist() == [11.0, 0.0, 12.0, 0.0, 0.0]
