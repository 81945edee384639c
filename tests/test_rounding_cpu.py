"""The compiled CPU kernels for half tables (embeddings/rounding_cpu.py) against the
torch recipe of embeddings/rounding.py and torch's own embedding_bag: same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embeddings.lookup import _half_bags
from embeddings.rounding import stochastic_round
from tests.rounding_cases import bits_equal, coordinates, values

pytest.importorskip("numba")
from embeddings import rounding_cpu

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [1, 13, 64])
def test_compiled_rounding_equals_the_torch_recipe(dtype: torch.dtype, dim: int) -> None:
    x = values(3000, dim, seed=dim)
    x.view(-1)[20] = float("nan")
    tables, rows, col0 = coordinates(3000, seed=1)
    for step in (1, 2, 1 << 33):
        got = rounding_cpu.stochastic_round_cpu(x, dtype, 5, step, tables, rows, col0)
        want = stochastic_round(x, dtype, 5, step, tables, rows, col0, compiled=False)
        assert got.dtype == dtype and bits_equal(got, want)


@pytest.mark.parametrize("dtype", HALF)
def test_compiled_rounding_equals_the_torch_recipe_at_every_exponent(dtype: torch.dtype) -> None:
    """Every fp32 exponent (subnormals to NaNs, 64 values each, random significands and
    signs) rounded in the kernels' 32-bit arithmetic equals the torch recipe."""
    g = torch.Generator().manual_seed(11)
    exponent = torch.arange(256 * 64) // 64
    bits = (torch.randint(0, 1 << 23, (256 * 64,), generator=g) | (exponent << 23)
            | (torch.randint(0, 2, (256 * 64,), generator=g) << 31))
    x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32).view(256, 64)
    tables, rows, col0 = coordinates(256, seed=12)
    got = rounding_cpu.stochastic_round_cpu(x, dtype, 3, 8, tables, rows, col0)
    want = stochastic_round(x, dtype, 3, 8, tables, rows, col0, compiled=False)
    assert bits_equal(got, want)


@pytest.mark.parametrize("dtype", HALF)
def test_fused_update_equals_gather_add_round_scatter(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    weight = values(5000, 24, seed=4).to(dtype)
    ids = torch.randperm(5000, generator=g)[:1200]
    grad = torch.randn(1200, 24, generator=g) * torch.logspace(-6, 5, 1200).unsqueeze(1)
    tables, rows, col0 = coordinates(1200, seed=5)
    want = weight.clone()
    new = want.index_select(0, ids).float().add_(grad, alpha=-0.3)  # torch's fp32 fused multiply-add
    rounded = stochastic_round(new, dtype, 9, 4, tables, rows, col0, compiled=False)
    want.index_copy_(0, ids, rounded)
    got = weight.clone()
    overflow = rounding_cpu.add_rows_rounded(got, ids, grad, -0.3, 9, 4, tables, rows, col0)
    assert bits_equal(got, want)
    untouched = torch.ones(5000, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(got[untouched].view(torch.int16), weight[untouched].view(torch.int16))
    if dtype == torch.float16:  # rows where a finite sum became inf, exactly
        expected = (torch.isinf(rounded) & torch.isfinite(new)).any(dim=1)
        assert expected.any() and torch.equal(overflow, expected)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("single_hot", [False, True])
def test_half_bags_equal_embedding_bag_of_the_widened_rows(dtype: torch.dtype, mean: bool,
                                                            single_hot: bool) -> None:
    """The lookup of half rows (embeddings/lookup.py), compiled, bags of one id and
    longer ones, against embedding_bag over the rows widened by torch."""
    g = torch.Generator().manual_seed(6)
    weight = (torch.randn(700, 20, generator=g)).to(dtype)
    lengths = torch.ones(300, dtype=torch.int64) if single_hot else torch.randint(0, 5, (300,), generator=g)
    ids = torch.randint(0, 700, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    scale = None
    if mean:
        scale = torch.repeat_interleave(1.0 / lengths.clamp(min=1).float(), lengths)
    got = _half_bags(weight, ids, offsets, scale)
    want = F.embedding_bag(ids, weight.float(), offsets, mode="sum", include_last_offset=True,
                           per_sample_weights=scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    one = lengths == 1  # a bag of one row is that row, widened exactly (mean: x 1.0)
    assert torch.equal(got[one], weight.float()[ids[offsets[:-1][one]]])


@pytest.mark.parametrize("dtype", HALF)
def test_widening_is_exact_for_every_half_value(dtype: torch.dtype) -> None:
    """Every one of the 65,536 bit patterns (zeros, subnormals, infinities, NaNs) widened
    in the kernels, alone and pooled with a zero row, equals torch's conversion."""
    table = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).view(1024, 64)
    zero = torch.zeros(1, 64, dtype=dtype)
    weight = torch.cat([table, zero])
    ids = torch.randperm(1024, generator=torch.Generator().manual_seed(1))
    want = weight.float()[ids]

    def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:  # bits, a NaN need only be a NaN
        nan = torch.isnan(b)
        return torch.equal(torch.isnan(a), nan) and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])

    assert same_floats(rounding_cpu.widen_half_rows(weight, ids), want)
    pairs = torch.stack([ids, torch.full_like(ids, 1024)], dim=1).flatten()  # each row + the zero row
    pooled = rounding_cpu.pool_half_bags(weight, pairs, torch.arange(0, 2 * 1024 + 1, 2), None)
    assert same_floats(pooled, want + 0.0)  # x + 0.0: -0.0 pools to +0.0 as embedding_bag's sum


# Run in a fresh interpreter with an empty numba cache, as on a fresh machine: two CPU
# collections (bf16 weight + fp16 Adagrad state, fp16 weight + bf16 Adam state) are
# built, then trained a step on multi-hot bags and one on single ids, then called
# with int32 and strided coordinates; printed: the compiled signatures per kernel
# after building and after the rest.
FIRST_STEPS = """
import json, torch
from data.jagged import JaggedFeatures
from embeddings import rounding_cpu
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.table import TableSpec

def compiled():
    return {f"{bf16}.{k.py_func.__name__}": len(k.signatures)
            for bf16 in (True, False) for k in rounding_cpu._kernels(bf16)}

cases = [("bf16", "adagrad", "fp16"), ("fp16", "adam", "bf16")]
tables = [[TableSpec("t0", rows=40, dim=8, features=("a",), dtype=w),
           TableSpec("t1", rows=30, dim=8, features=("b",), dtype=w)] for w, _, _ in cases]
colls = [LocalEmbeddingCollection(t, make_sparse_optimizer(kind, state_dtype=s), seed=1)
         for t, (_, kind, s) in zip(tables, cases)]
before = compiled()
g = torch.Generator().manual_seed(0)
for lengths in (torch.randint(0, 4, (2 * 64,), generator=g), torch.ones(2 * 64, dtype=torch.int64)):
    kjt = JaggedFeatures(keys=["a", "b"], values=torch.randint(0, 30, (int(lengths.sum()),), generator=g),
                         lengths=lengths)
    for coll in colls:
        coll.set_lr(0.1)
        coll(kjt).square().sum().backward()
        coll.step()
# ids and coordinates of another type or strided reach the kernels as they were compiled
odd = torch.arange(4, dtype=torch.int32)[::2]
rounding_cpu.stochastic_round_cpu(torch.ones(2, 3), torch.bfloat16, 0, 1, odd, odd, odd)
rounding_cpu.add_rows_rounded(colls[1].weight.data, odd, torch.ones(2, 8), 0.1, 0, 1, odd, odd, odd)
print(json.dumps({"before": before, "after": compiled()}))
"""


@pytest.mark.slow  # a fresh interpreter compiling every kernel: ~10 s here
def test_building_a_half_cpu_collection_compiles_what_its_steps_call(tmp_path) -> None:
    """A fresh process's first steps compile nothing: building the collections did
    (rounding_cpu.compile_for); without it each first call compiled mid-training."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    proc = subprocess.run([sys.executable, "-c", FIRST_STEPS], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    used = {name for name, n in counts["after"].items() if n}
    # the kernels these tables and states call: every one, of both types
    assert used == {f"{bf16}.{name}" for bf16 in (True, False)
                    for name in ("round_rows", "add_round_rows", "pool_bags", "widen_rows")}
    assert counts["after"] == counts["before"]


# Run twice, in two fresh interpreters sharing one numba cache dir: what a CPU collection
# compiles at its build for bf16 and fp16 weights with bf16 and fp16 state; printed: per
# kernel, the signatures it holds and numba's count of cache hits and misses (each miss
# is a compile), and the seconds the build's compile took.
COMPILE_ALL = """
import json, time, torch
from embeddings import rounding_cpu

start = time.perf_counter()
for weight in (torch.bfloat16, torch.float16):
    rounding_cpu.compile_for(torch.device("cpu"), weight, [torch.bfloat16, torch.float16])
seconds = time.perf_counter() - start
names = {f"{bf16}.{k.py_func.__name__}": k for bf16 in (True, False) for k in rounding_cpu._kernels(bf16)}
print(json.dumps({"seconds": seconds, "kernels": {
    name: {"signatures": len(k.signatures), "hits": sum(k.stats.cache_hits.values()),
           "misses": sum(k.stats.cache_misses.values())} for name, k in names.items()}}))
"""


@pytest.mark.slow  # two fresh interpreters, the first compiling every kernel: ~10 s here
def test_a_second_process_loads_every_kernel_from_the_disk_cache(tmp_path) -> None:
    """numba's disk cache keeps every kernel: a second process (a test, a torchrun rank,
    the next run) with the same cache dir loads them and compiles nothing. A kernel whose
    closure holds a dispatcher misses in every process (the dispatcher's pickle carries a
    per-process id into the cache key)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", COMPILE_ALL], cwd=Path(__file__).resolve().parents[1],
                              env=env, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = (run["kernels"] for run in runs)
    used = {name for name, k in first.items() if k["signatures"]}
    assert used == set(first)  # every kernel of both types
    assert all(first[name]["misses"] == first[name]["signatures"] for name in used)  # it compiled
    for name in used:  # and the second loaded the same signatures, compiling none
        assert second[name] == {"signatures": first[name]["signatures"],
                                "hits": first[name]["signatures"], "misses": 0}, (name, second[name])
