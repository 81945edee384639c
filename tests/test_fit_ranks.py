"""The vocabulary pass split over ranks (each counts row groups[rank::W], the integer
counts merged by value range over a real gloo group, or everything all-gathered) equals the one-process pass bit for bit: the
saved preprocessing.json and every vocabulary file are byte-identical to a single
process with no split and no sketch, at 1, 2 and 3 ranks, with ties, min_frequency
(the sketch pre-filter on) and max_rows; int, string and list columns over 3 files."""

from __future__ import annotations

from pathlib import Path

import pytest

from data import preprocess
from data.schema import infer_schema
from tests.multiprocess import run_ranks
from tests.test_fit_split import _files, _saved


def _rank_fit(rank: int, world: int, files: list[str], kw: dict, out: str,
              by_range: bool = True) -> dict[str, bytes]:
    """One rank's fit; ``by_range``: integer counts merged by value range
    (data/fit_exchange.py, as ``dlrm train`` does), else all gathered as objects."""
    import torch.distributed as dist

    from dlrm.parallel.distributed import all_to_all_arrays

    def gather(obj: object) -> list[object]:
        got: list[object] = [None] * world
        dist.all_gather_object(got, obj)
        return got

    opts = preprocess.Options(**kw, rank=rank, world=world, gather=gather,
                              exchange=all_to_all_arrays if by_range else None)
    target = Path(out) / f"r{rank}"
    prep = preprocess.fit(files, infer_schema(files), opts)
    preprocess.save(prep, target)
    return {str(p.relative_to(target)): p.read_bytes() for p in sorted(target.rglob("*"))
            if p.is_file()}


# (min_frequency, max_rows): every id kept; the sketch pre-filter on, rows capped
LIMITS = [(1, 0), (3, 12)]


def _rank_fits(rank: int, world: int, files: list[str], fits: list[tuple[dict, bool]],
               out: str) -> list[dict[str, bytes]]:
    """Each of ``fits`` (options, by_range) in turn, in one launch: a group's processes
    cost more to start than the fits do."""
    return [_rank_fit(rank, world, files, kw, f"{out}/{i}", by_range)
            for i, (kw, by_range) in enumerate(fits)]


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_split_equals_one_process(tmp_path: Path) -> None:
    files = _files(tmp_path)
    kws = [{"encoding": "vocabulary", "min_frequency": min_frequency, "max_rows": max_rows,
            "dense_transform": "standardize"} for min_frequency, max_rows in LIMITS]
    ones = [_saved(files, preprocess.Options(**kw, sketch=False), tmp_path / f"one{i}")
            for i, kw in enumerate(kws)]
    assert all(len(one) == 4 for one in ones)
    for world, modes in ((1, (True,)), (2, (True,)), (3, (True, False))):
        fits = [(kw, by_range) for kw in kws for by_range in modes]
        results = run_ranks(world, _rank_fits, files, fits, str(tmp_path / f"w{world}"))
        for rank, got in enumerate(results):
            for (kw, by_range), fit in zip(fits, got, strict=True):
                one = ones[kws.index(kw)]
                assert fit == one, (world, by_range, rank, kw["min_frequency"], kw["max_rows"])


def test_unreadable_share_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    """A rank whose share cannot be read: the gathered error line, on every rank."""
    from data.errors import DataError
    from data.fit_split import Split, _gathered

    with pytest.raises(DataError, match="part-1.parquet: row group 2"):
        _gathered({}, Split(rank=0, world=2,
                            gather=lambda o: [o, "part-1.parquet: row group 2: cannot read"]))


def _resolve(rank: int, world: int, train: str, out: str) -> dict[str, bytes]:
    """resolve_data under the run's process group (prep_options wires the gather)."""
    from dlrm.train.inputs import prep_options, resolve_data
    from tests.test_preprocess_train import cfg_for

    cfg = cfg_for(Path(train), Path(train), "data.min_frequency=2")
    opts = prep_options(cfg)
    assert (opts.rank, opts.world, opts.progress) == (rank, world, rank == 0)
    target = Path(out) / f"r{rank}"
    preprocess.save(resolve_data(cfg).preprocess, target)
    return {str(p.relative_to(target)): p.read_bytes() for p in sorted(target.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
@pytest.mark.distributed
def test_training_fit_under_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """The fit ``dlrm train`` runs on every rank, split over 2 ranks, saves what one
    process without a group saves (string and list columns, min_frequency 2)."""
    from tests.test_preprocess_train import string_dataset

    train = string_dataset(tmp_path / "train", 1500, 1)
    one = _resolve(0, 1, str(train), str(tmp_path / "one"))
    assert len(one) >= 2
    for rank, got in enumerate(run_ranks(2, _resolve, str(train), str(tmp_path / "two"))):
        assert got == one, rank
