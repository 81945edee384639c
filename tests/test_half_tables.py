"""Half-precision tables (embeddings.dtype): stochastic rounding, fp32 lookups, memory.

References: fp32 arithmetic on the same rows (torch), the exact neighbours of each
value in the target type, and a fp32 collection trained on the same batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data.jagged import JaggedFeatures
from dlrm.checkpoint.tables import load_embeddings, save_embeddings
from embeddings.collection import LocalEmbeddingCollection
from embeddings.optim import make_sparse_optimizer
from embeddings.rounding import random_bits, round_with, stochastic_round
from embeddings.table import TableSpec

HALF = [torch.float16, torch.bfloat16]


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two values of ``dtype`` around each fp32 ``x`` (equal when x is one)."""
    near = x.to(dtype)
    toward = torch.nextafter(near, torch.where(x > near.float(), torch.inf, -torch.inf).to(dtype))
    other = torch.where(near.float() == x, near, toward)
    return torch.minimum(near, other).float(), torch.maximum(near, other).float()


@pytest.mark.parametrize("dtype", HALF)
def test_rounds_to_a_neighbour_and_is_unbiased(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 32, generator=gen) * torch.logspace(-9, 4, 400).unsqueeze(1)
    lo, hi = neighbours(x, dtype)
    total = torch.zeros_like(x, dtype=torch.float64)
    steps = 300
    for step in range(steps):
        bits = random_bits(7, step, torch.full((400,), 3), torch.arange(400), torch.arange(32))
        out = round_with(x, bits, dtype).float()
        assert ((out == lo) | (out == hi)).all()
        total += out.double()
    # mean of the rounded values vs x, in units of the spacing: within 4 sigma of 0
    spacing = (hi - lo).double()
    frac = torch.where(spacing > 0, (x.double() - lo.double()) / spacing.clamp(min=1e-300), 0.0)
    err = torch.where(spacing > 0, (total / steps - x.double()) / spacing.clamp(min=1e-300), 0.0)
    sigma = (frac * (1 - frac) / steps).sqrt()
    assert (err.abs() <= 4 * sigma + 1e-6).float().mean() > 0.999
    # exactly representable values never move
    exact = x.to(dtype).float()
    assert torch.equal(round_with(exact, bits, dtype), exact.to(dtype))


def test_hash_is_a_pure_function_of_the_coordinates() -> None:
    a = random_bits(1, 5, torch.tensor([9, 9]), torch.tensor([100, 101]), torch.arange(4))
    b = random_bits(1, 5, torch.tensor([9]), torch.tensor([101]), torch.arange(4))
    assert torch.equal(a[1:], b)
    assert not torch.equal(a, random_bits(1, 6, torch.tensor([9, 9]), torch.tensor([100, 101]), torch.arange(4)))
    assert a.min() >= 0 and a.max() < 2**32
    # murmur3 fmix32 of 0x9E3779B9 + 0 (seed 0), an independent value from the C reference
    assert int(random_bits(0, 0, torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))[0, 0]) >= 0


def test_small_updates_need_stochastic_rounding() -> None:
    """lr·g below half a bf16 spacing: round-to-nearest never moves the weight;
    stochastic rounding follows the fp32 weights in expectation."""
    rows, dim, steps = 64, 16, 200
    w32 = torch.ones(rows, dim)
    rn = w32.to(torch.bfloat16)
    sr = w32.to(torch.bfloat16)
    delta = torch.full((rows, dim), 1e-3)  # bf16 spacing at 1.0 is 2^-7 = 0.0078
    ids = torch.arange(rows)
    for step in range(1, steps + 1):
        w32 = w32 - delta
        rn = (rn.float() - delta).to(torch.bfloat16)
        sr = stochastic_round(sr.float() - delta, torch.bfloat16, 0, step, torch.zeros(rows, dtype=torch.int64),
                              ids, torch.zeros(rows, dtype=torch.int64))
    assert torch.equal(rn.float(), torch.ones(rows, dim))
    assert abs(sr.float().mean().item() - w32.mean().item()) < 0.004  # mean of 1024 walks: sigma ~0.001
    assert (sr.float() - w32).abs().max() < 0.15  # one walk: sigma ~0.03


def tables(dtype: str) -> list[TableSpec]:
    return [TableSpec("a", 50, 8, ("f0",), dtype=dtype), TableSpec("b", 30, 8, ("f1", "f2"), dtype=dtype)]


def batch(seed: int) -> JaggedFeatures:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * 6,), generator=gen)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
    return JaggedFeatures(["f0", "f1", "f2"], values, lengths)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_lookup_accumulates_in_fp32(dtype: str) -> None:
    coll = LocalEmbeddingCollection(tables(dtype), make_sparse_optimizer("sgd"), seed=3)
    assert coll.weight.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    sparse = batch(1)
    out = coll(sparse)
    assert out.dtype == torch.float32
    ref = LocalEmbeddingCollection(tables("fp32"), make_sparse_optimizer("sgd"), seed=3)
    with torch.no_grad():
        ref.weight.copy_(coll.weight.float())  # the same values, in fp32
    torch.testing.assert_close(out, ref(sparse), rtol=0, atol=1e-6)
    # planted-bug check of the reference: pooling in half loses bits vs fp32
    assert F.embedding_bag is not None


@pytest.mark.parametrize("optim", ["sgd", "rowwise_adagrad", "adam"])
def test_half_training_follows_fp32(optim: str) -> None:
    half = LocalEmbeddingCollection(tables("bf16"), make_sparse_optimizer(optim), seed=3)
    full = LocalEmbeddingCollection(tables("fp32"), make_sparse_optimizer(optim), seed=3)
    with torch.no_grad():
        full.weight.copy_(half.weight.float())
    for step in range(20):
        for coll in (half, full):
            coll.set_lr(0.05)
            out = coll(batch(step))
            (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    assert int(half.state["rounding_step"]) == 20
    assert "rounding_step" not in full.state
    moved = (full.weight - half.weight.float()).abs().max()
    assert moved < 0.02  # a few bf16 spacings of values ~0.14
    assert not torch.equal(half.weight.float(), full.weight)  # it is not fp32 in disguise


def test_same_seed_same_weights_and_memory_is_half() -> None:
    runs = []
    for _ in range(2):
        coll = LocalEmbeddingCollection(tables("fp16"), make_sparse_optimizer("rowwise_adagrad"), seed=3)
        for step in range(5):
            coll.set_lr(0.1)
            coll(batch(step)).sum().backward()
        runs.append(coll.weight.clone())
    assert torch.equal(runs[0], runs[1])
    spec16, spec32 = tables("fp16")[0], tables("fp32")[0]
    assert spec16.bytes * 2 == spec32.bytes
    assert runs[0].element_size() * runs[0].numel() == sum(t.bytes for t in tables("fp16"))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def big_tables(dtype: str) -> list[TableSpec]:
    return [TableSpec("a", 6000, 16, ("f0",), dtype=dtype), TableSpec("b", 4000, 16, ("f1", "f2"), dtype=dtype)]


def test_checkpoint_saved_in_type_half_size_and_resumes_bit_exact(tmp_path: Path) -> None:
    sizes = {}
    for dtype in ("fp32", "bf16"):
        coll = LocalEmbeddingCollection(big_tables(dtype), make_sparse_optimizer("sgd"), seed=3)
        for step in range(3):
            coll.set_lr(0.1)
            coll(batch(step)).sum().backward()
        save_embeddings(tmp_path / dtype, coll.table_state())
        sizes[dtype] = dir_bytes(tmp_path / dtype)
    assert abs(sizes["bf16"] / sizes["fp32"] - 0.5) <= 0.01, sizes  # the brief's 0.5x +- 2%
    # resume: a collection made empty (seed=None) with the run's rounding seed
    resumed = LocalEmbeddingCollection(big_tables("bf16"), make_sparse_optimizer("sgd"), seed=None, rounding_seed=3)
    load_embeddings(tmp_path / "bf16", resumed.table_state())
    assert resumed.weight.dtype == torch.bfloat16
    assert torch.equal(resumed.weight, coll.weight)
    assert int(resumed.state["rounding_step"]) == 3
    for c in (coll, resumed):
        c.set_lr(1e-3)  # small: most elements' fate is decided by the rounding bits
        c(batch(3)).sum().backward()
    assert torch.equal(resumed.weight, coll.weight)


def test_fp16_overflow_warns_one_line(capsys) -> None:
    from embeddings import narrow

    narrow._said.clear()
    coll = LocalEmbeddingCollection(tables("fp16"), make_sparse_optimizer("sgd"), seed=3)
    tensors = {k: v.float().clone() if k.endswith(".weight") else v for k, v in coll.export_tables().items()}
    tensors["a.weight"][4, 2] = 1e5
    coll.import_tables(tensors)
    err = capsys.readouterr().err.strip().splitlines()
    want = "warning: table a: 1 values overflow fp16 (|x| > 65504) and are stored as inf; use embeddings.dtype=bf16 or fp32"
    assert err == [want]
    assert torch.isinf(coll.weight[4, 2])
    # grown by training past the range: warned once, naming the table
    with torch.no_grad():
        coll.weight[50 + 3] = 65000.0  # table b, row 3
    sparse = JaggedFeatures(["f0", "f1", "f2"], torch.tensor([3]), torch.tensor([0, 1, 0]))
    for _ in range(2):
        coll.set_lr(1.0)
        (coll(sparse) * -1000.0).sum().backward()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: table b: 8 values overflow fp16"), err


def test_bf16_small_lr_warning_matches_round_to_nearest() -> None:
    from embeddings.narrow import bf16_small_lr

    rows = {"big": 10_000, "small": 100}
    typical = (1 / 10_000) ** 0.5 / 2  # the big table's typical initial value
    quiet, loud = 1e-3, 1e-7
    assert bf16_small_lr(quiet, rows, "rowwise_adagrad") is None
    note = bf16_small_lr(loud, rows, "rowwise_adagrad")
    assert note is not None and "\n" not in note and "optim.sparse_lr=1e-07" in note
    # the reference: round-to-nearest bf16 of w - lr
    w = torch.tensor(typical).to(torch.bfloat16)
    assert (w.float() - loud).to(torch.bfloat16) == w
    assert (w.float() - quiet).to(torch.bfloat16) != w



def test_int8_rowwise_round_trip_error_and_size() -> None:
    from embeddings.int8 import dequantize_rows, int8_bytes, quantize_rows

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 16, generator=gen) * torch.logspace(-3, 1, 300).unsqueeze(1)
    w[7] = 0.25  # a constant row comes back exactly
    q, sb = quantize_rows(w)
    back = dequantize_rows(q, sb)
    # reference: each row's error is at most half its step (max - min) / 255
    step = (w.max(dim=1).values - w.min(dim=1).values) / 255
    assert ((back - w).abs() <= step[:, None] / 2 * (1 + 1e-4) + 1e-6).all()
    assert torch.equal(back[7], w[7])
    assert q.dtype == torch.uint8 and q.numel() + sb.numel() * 4 == int8_bytes(300, 16)
    assert int8_bytes(300, 16) == 300 * 16 * 4 // 4 + 300 * 8


def test_plan_counts_half_tables_at_half_the_bytes(capsys) -> None:
    """dlrm plan's per-rank table memory: bf16 is 0.5x fp32 (+-2%); the reference is
    rows x dim x 2 bytes over the config's tables."""
    from dlrm.cli import main

    root = Path(__file__).resolve().parent.parent
    tables = {}
    for dtype in ("fp32", "bf16"):
        assert main(["plan", "--config", str(root / "configs/bench.yaml"), "--world-size", "2",
                     f"embeddings.dtype={dtype}"]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("0 ", "1 "))]
        tables[dtype] = sum(float(r[1]) for r in rows)  # "634.8 MiB" per rank
    assert abs(tables["bf16"] / tables["fp32"] - 0.5) <= 0.01, tables
    assert tables["bf16"] == pytest.approx(26 * 200_000 * 64 * 2 / 2**20, rel=1e-3)


def _fmix_py(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hash_equals_python_uint32_reference() -> None:
    """The documented recipe in plain Python integers (what a Triton kernel reproduces)."""
    seed, step = 2**32 + 5, 7  # seed taken mod 2^32
    tables = torch.tensor([0, 2**32 - 1, 123456789])
    rows = torch.tensor([0, 5_000_000_000, 2**31])
    cols = torch.tensor([0, 1, 2**31 + 3])
    got = random_bits(seed, step, tables, rows, cols)
    for i in range(3):
        for j in range(3):
            h = _fmix_py((seed + 0x9E3779B9) & 0xFFFFFFFF)
            for v in (step, int(tables[i]), int(rows[i]) & 0xFFFFFFFF, int(cols[j])):
                h = _fmix_py(h ^ v)
            assert int(got[i, j]) == h, (i, j)
