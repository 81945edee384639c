"""The host row kernels (embeddings/host_rows.py) against torch's index_select and
index_copy_: the same bits, for every element size, table shape and thread count."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("numba")
from embeddings.host_rows import gather_rows, store_rows

# (dtype, row shape): fp32 and half rows, a row-wise state [R]; rows copied as 8-byte
# words, and rows whose bytes are not a multiple of 8 (as 2-, 4- and 1-byte words)
CASES = [(torch.float32, (64,)), (torch.bfloat16, (12,)), (torch.float16, (100,)),
         (torch.float32, ()), (torch.float64, (3,)), (torch.int8, (24,)),
         (torch.bfloat16, (13,)), (torch.float32, (5,)), (torch.int8, (5,))]


def _table(rows: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(rows, *shape, generator=g).to(dtype)
    return torch.randint(-128, 128, (rows, *shape), generator=g).to(dtype)


def _ids(rows: int, count: int, seed: int) -> torch.Tensor:
    """``count`` distinct ids of ``rows``, not sorted, the first and last row among them."""
    g = torch.Generator().manual_seed(seed)
    rest = torch.randperm(rows - 2, generator=g)[:count - 2] + 1
    return torch.cat([torch.tensor([0, rows - 1]), rest])


@pytest.mark.parametrize("dtype,shape", CASES)
@pytest.mark.parametrize("threads", [1, 3])
def test_gather_equals_index_select(dtype: torch.dtype, shape: tuple[int, ...], threads: int) -> None:
    table = _table(5000, shape, dtype, seed=1)
    ids = torch.cat([_ids(5000, 1200, seed=2), torch.tensor([7, 7, 7])])  # a repeated id too
    out = torch.full((ids.numel(), *shape), 3).to(dtype)
    with ThreadPoolExecutor(threads) as pool:
        got = gather_rows(table, ids, out, pool, threads)
    assert got is out
    assert torch.equal(out.view(torch.uint8), torch.index_select(table, 0, ids).view(torch.uint8))


@pytest.mark.parametrize("dtype,shape", CASES)
@pytest.mark.parametrize("threads", [1, 4])
def test_store_equals_index_copy(dtype: torch.dtype, shape: tuple[int, ...], threads: int) -> None:
    table = _table(5000, shape, dtype, seed=3)
    ids = _ids(5000, 1500, seed=4)
    assert ids.unique().numel() == ids.numel()  # distinct: a repeated id's row is not promised
    rows = _table(1500, shape, dtype, seed=5)
    want = table.clone().index_copy_(0, ids, rows)
    with ThreadPoolExecutor(threads) as pool:
        store_rows(table, ids, rows, pool, threads)
    assert torch.equal(table.view(torch.uint8), want.view(torch.uint8))


def test_no_ids_copy_nothing() -> None:
    table = _table(10, (4,), torch.float32, seed=6)
    before = table.clone()
    out = torch.empty(0, 4)
    assert gather_rows(table, torch.empty(0, dtype=torch.int64), out).shape == (0, 4)
    store_rows(table, torch.empty(0, dtype=torch.int64), out)
    assert torch.equal(table, before)


@pytest.mark.parametrize("bad", [10, -1])
def test_an_id_out_of_range_raises_as_torch_does(bad: int) -> None:
    """The kernels do not check bounds by themselves: they say so, where torch would."""
    table = _table(10, (4,), torch.float32, seed=7)
    ids = torch.tensor([1, 2, bad, 3])
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
        gather_rows(table, ids, torch.empty(4, 4))
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
        store_rows(table, ids, torch.zeros(4, 4))
    with pytest.raises(IndexError):  # torch's own call, the reference
        torch.index_select(table, 0, ids)


def test_what_the_kernels_do_not_take_goes_to_torch() -> None:
    """A table not contiguous (a column slice), or ids of another type: torch's calls,
    the same result."""
    wide = _table(50, (8,), torch.float32, seed=8)
    table = wide[:, :4]
    ids = torch.tensor([3, 40, 0], dtype=torch.int32)
    out = torch.empty(3, 4)
    assert torch.equal(gather_rows(table, ids, out), table[ids.long()])
    rows = torch.ones(3, 4)
    store_rows(table, ids.long(), rows)
    param = torch.nn.Parameter(torch.randn(9, 4))  # numpy cannot view it
    with torch.no_grad():  # index_select's out= refuses autograd
        got = gather_rows(param, torch.tensor([8, 1]), torch.empty(2, 4))
    assert torch.equal(got, param.detach()[[8, 1]])
    assert torch.equal(wide[[3, 40, 0], :4], rows) and torch.equal(wide[[3, 40, 0], 4:], _table(50, (8,), torch.float32, seed=8)[[3, 40, 0], 4:])


def test_rows_not_on_8_byte_addresses_are_copied_as_elements() -> None:
    flat = torch.randn(5000 * 64 + 1, generator=torch.Generator().manual_seed(9))
    table = flat[1:].view(5000, 64)  # 4 bytes past an 8-byte address
    assert table.data_ptr() % 8 == 4
    ids = _ids(5000, 700, seed=10)
    out = torch.empty(700, 64)
    assert torch.equal(gather_rows(table, ids, out), table.index_select(0, ids))
    rows = torch.randn(700, 64)
    want = table.clone().index_copy_(0, ids, rows)
    store_rows(table, ids, rows)
    assert torch.equal(table, want)


_BUILD = """
import sys
import dlrm.train.trainer  # noqa: F401
print("numba" in sys.modules)
from embeddings.hotline.tiers import HotlineEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from tests.test_embeddings import random_kjt, tables_fixture
from tests.test_hotline import FEATURES, profile_of, rows_of, touched
tables = tables_fixture()
kjt = random_kjt(FEATURES, rows_of(tables), batch=16, max_len=2, seed=3)
hot = {name: ids[ids % 5 != 0] for name, ids in touched(tables, [kjt]).items()}
HotlineEmbeddingCollection(tables, profile_of(tables, hot), make_sparse_optimizer("rowwise_adagrad"),
                           fused=True, seed=1, gather_threads=int(sys.argv[1]))
print("numba" in sys.modules)
if "numba" in sys.modules:
    from embeddings import host_rows_kernels as k
    print(len(k.copy_rows.signatures))
"""


@pytest.mark.slow
@pytest.mark.parametrize("threads", [0, 1])
def test_a_host_tier_loads_its_kernels_when_built_and_nothing_else_imports_numba(threads: int) -> None:
    """The trainer's import brings no numba (50 MiB of every fp32 process); a host tier
    that gathers on threads of ours compiles (or loads) its kernels when it is built,
    the weight's and the row-wise state's (so no step starts numba: 0.4 s here), and
    one that gathers with torch (0) imports nothing."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", _BUILD, str(threads)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=True)
    lines = proc.stdout.split("\n")
    assert lines[0] == "False"
    assert lines[1] == str(threads > 0)
    if threads:
        assert lines[2] == "2"  # 8-byte words (the rows), 4-byte words (row-wise sums)
