"""convert_criteo against a line-by-line Python reference parse.

The real Criteo samples live in the ``shared`` folder beside the checkout and are
never copied into the repository; tests that need them skip when it is absent.
"""

from __future__ import annotations

import gzip
import math
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.criteo import convert_criteo
from data.errors import DataError, UserError

SHARED = Path(__file__).resolve().parents[2] / "shared/data/criteo"
HEAD10K = SHARED / "criteo_kaggle_train_head10k.tsv"
PADDLE = SHARED / "criteo_paddlerec_part-0.tsv"
DEEPCTR = SHARED / "criteo_sample.txt"  # comma-separated, a header line, ints written 260.0
needs_shared = pytest.mark.skipif(not HEAD10K.is_file(), reason="shared Criteo samples absent")


def _reference(line: str, max_ind_range: int = 0, sep: str = "\t") -> list[float]:
    """One TSV (or CSV) line parsed the obvious way: label, 13 log1p ints, 26 ids."""
    fields = line.rstrip("\n").split(sep)
    assert len(fields) == 40
    dense = [math.log1p(max(_whole(x), 0)) if x else 0.0 for x in fields[1:14]]
    ids = []
    for h in fields[14:]:
        if not h:
            ids.append(0)
        elif max_ind_range:
            ids.append(int(h, 16) % (max_ind_range - 1) + 1)
        else:
            ids.append(int(h, 16) + 1)
    return [float(fields[0]), *dense, *ids]


def _whole(x: str) -> int:
    value = float(x)
    assert value == int(value), x
    return int(value)


def _table(files: list[str]) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in files])


def _check_against_reference(table: pa.Table, lines: list[str], max_ind_range: int = 0,
                             sep: str = "\t") -> None:
    want = np.array([_reference(x, max_ind_range, sep) for x in lines])
    got = table.slice(0, len(lines))
    for j, name in enumerate(got.column_names):
        col = got.column(name).to_numpy()
        if name.startswith("C"):
            np.testing.assert_array_equal(col, want[:, j].astype(np.int64), err_msg=name)
        else:
            np.testing.assert_allclose(col, want[:, j], rtol=1e-6, err_msg=name)


def test_small_hand_written_lines(tmp_path: Path) -> None:
    src = tmp_path / "small.tsv"
    rows = [
        ["1", "", "-3", "7", *[""] * 10, "00000000", "ffffffff", "ABCDEF01", "", *["a"] * 22],
        ["0", *[str(i) for i in range(13)], *[""] * 26],
    ]
    src.write_text("".join("\t".join(r) + "\n" for r in rows))
    files = convert_criteo([str(src)], str(tmp_path / "out"))
    t = _table(files)
    assert t.schema.field("label").type == pa.float32() and t.schema.field("I1").type == pa.float32()
    assert t.schema.field("C1").type == pa.int64()
    assert t.column("I2").to_pylist() == [0.0, pytest.approx(math.log(2))]
    assert t.column("I3").to_pylist() == [pytest.approx(math.log(8)), pytest.approx(math.log(3))]
    first_ids = [t.column(f"C{i}")[0].as_py() for i in range(1, 6)]
    assert first_ids == [1, 2**32, 0xABCDEF01 + 1, 0, 11]
    assert all(t.column(f"C{i}")[1].as_py() == 0 for i in range(1, 27))
    _check_against_reference(t, ["\t".join(r) + "\n" for r in rows])


@needs_shared
def test_kaggle_sample_matches_reference_in_every_cell(tmp_path: Path) -> None:
    lines = HEAD10K.read_text().splitlines(keepends=True)
    files = convert_criteo([str(HEAD10K)], str(tmp_path), row_group_rows=1000, file_rows=4000)
    assert [pq.ParquetFile(f).metadata.num_rows for f in files] == [4000, 4000, 2000]
    assert pq.ParquetFile(files[0]).metadata.num_row_groups == 4
    assert sorted(os.listdir(tmp_path)) == [f"part-0000{i}.parquet" for i in range(3)]
    table = _table(files)
    assert table.num_rows == len(lines) == 10_000
    _check_against_reference(table, lines[:300])
    _check_against_reference(table.slice(9_700), lines[9_700:])
    assert table.column("label").to_numpy().mean() == pytest.approx(0.2182)


@needs_shared
def test_max_ind_range_and_several_inputs(tmp_path: Path) -> None:
    files = convert_criteo([str(PADDLE), str(HEAD10K)], str(tmp_path), max_ind_range=1000)
    table = _table(files)
    assert table.num_rows == 100 + 10_000
    ids = np.stack([table.column(f"C{i}").to_numpy() for i in range(1, 27)])
    assert ids.min() == 0 and ids.max() < 1000 and ids.max() > 900
    _check_against_reference(table, PADDLE.read_text().splitlines(keepends=True), 1000)
    head = HEAD10K.read_text().splitlines(keepends=True)[:200]
    _check_against_reference(table.slice(100), head, 1000)


@pytest.mark.skipif(not DEEPCTR.is_file(), reason="shared Criteo samples absent")
def test_deepctrs_csv_sample_with_a_header_and_float_ints(tmp_path: Path) -> None:
    lines = DEEPCTR.read_text().splitlines(keepends=True)
    assert lines[0].startswith("label,I1,") and any(".0," in x for x in lines[1:])
    table = _table(convert_criteo([str(DEEPCTR)], str(tmp_path / "csv")))
    assert table.num_rows == len(lines) - 1 == 200
    _check_against_reference(table, lines[1:], sep=",")
    # 19 of its rows are rows of the Kaggle head too: converted from either format, the same
    kaggle = _table(convert_criteo([str(HEAD10K)], str(tmp_path / "tsv")))
    rows = {tuple(r.values()) for r in kaggle.to_pylist()}
    assert sum(tuple(r.values()) in rows for r in table.to_pylist()) == 19


@pytest.mark.parametrize("header,words", [
    ("label,I1,I2\n", "line 1: a header naming 3 columns (label, I1, I2, ...) where label, I1, I2, ..."),
    ("label\t" + "\t".join(f"I{i}" for i in range(1, 14)) + "\t" + "\t".join(f"C{i}" for i in range(26, 0, -1))
     + "\n", "line 1: a header naming 40 columns"),
])
def test_a_header_that_is_not_criteos_is_refused(tmp_path: Path, header: str, words: str) -> None:
    src = tmp_path / "h.csv"
    src.write_text(header + GOOD.replace("\t", "," if "," in header else "\t"))
    with pytest.raises(DataError, match=re.escape(words)):
        convert_criteo([str(src)], str(tmp_path / "out"))


def test_csv_with_a_header_counts_lines_from_the_header(tmp_path: Path) -> None:
    src = tmp_path / "bad.csv"
    header = ",".join(["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]) + "\n"
    good = GOOD.replace("\t", ",").replace(",5,", ",5.0,", 1)  # an int written as a float is one
    src.write_text(header + good * 2 + good.replace(",6,", ",6.5,", 1))
    with pytest.raises(DataError, match=r"column 'I6': line 4: '6.5' is not an integer"):
        convert_criteo([str(src)], str(tmp_path / "out"))
    src.write_text(header + good + "0,1\n")
    with pytest.raises(DataError, match=r"bad.csv: line 3: 2 fields where 40 were expected"):
        convert_criteo([str(src)], str(tmp_path / "out"))


@needs_shared
def test_gzip_input(tmp_path: Path) -> None:
    gz = tmp_path / "part.tsv.gz"
    gz.write_bytes(gzip.compress(PADDLE.read_bytes()))
    plain = _table(convert_criteo([str(PADDLE)], str(tmp_path / "a")))
    assert _table(convert_criteo([str(gz)], str(tmp_path / "b"))).equals(plain)


@needs_shared
def test_line_numbers_count_across_blocks(tmp_path: Path) -> None:
    src = tmp_path / "big.tsv"
    good = HEAD10K.read_bytes()
    src.write_bytes(good * 3 + b"1\t2\n")  # 7 MB: several parser blocks
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"big.tsv: line 30001: 2 fields where 40"):
        convert_criteo([str(src)], str(out), file_rows=10_000)
    assert os.listdir(out) == []  # the complete parts of the failed run are gone too


GOOD = "0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13" + "\t0a0b0c0d" * 26 + "\n"


@pytest.mark.parametrize("bad,line,words", [
    ("1\t2\t3\n", 3, "3 fields where 40 were expected"),
    (GOOD.replace("\t5\t", "\tx5\t", 1), 3, "column 'I5': line 3: 'x5' is not an integer"),
    (GOOD.replace("\t5\t", "\t5.5\t", 1), 3, "column 'I5': line 3: '5.5' is not an integer"),
    (GOOD.replace("0a0b0c0d", "0a0g", 1), 3, "column 'C1': line 3: '0a0g' is not hexadecimal"),
    (GOOD.replace("0", "7", 1), 3, "column 'label': line 3: label 7 is not 0 or 1"),
    ("\t" + GOOD[2:], 3, "column 'label': line 3: empty label"),
    ("\n", 3, "line 3"),
])
def test_malformed_lines_name_file_and_line(tmp_path: Path, bad: str, line: int,
                                            words: str) -> None:
    src = tmp_path / "bad.tsv"
    src.write_text(GOOD * 2 + bad + GOOD)
    out = tmp_path / "out"
    with pytest.raises(DataError) as e:
        convert_criteo([str(src)], str(out))
    assert str(src) in str(e.value) and words in str(e.value), str(e.value)
    assert not out.exists() or os.listdir(out) == []  # nothing half-written


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_gzip_is_one_error_naming_it_and_nothing_is_left(tmp_path: Path, damage: str) -> None:
    """A .gz cut short (a copy interrupted) or with a flipped byte: pyarrow's OSError,
    raised after the good blocks were converted, went up as a traceback (2026-12-07)."""
    whole = gzip.compress((GOOD * 40_000).encode())  # ~5 MB: more than one parser block
    gz = tmp_path / "day_0.gz"
    if damage == "truncated":
        gz.write_bytes(whole[: len(whole) // 2])
    else:
        data = bytearray(whole)
        data[len(data) // 2] ^= 0xFF
        gz.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(DataError) as e:
        convert_criteo([str(gz)], str(out), file_rows=10_000)
    assert str(gz) in str(e.value) and "cannot read" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() or os.listdir(out) == []


def test_missing_input_and_bad_range(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope.tsv"):
        convert_criteo([str(tmp_path / "nope.tsv")], str(tmp_path / "out"))
    (tmp_path / "days").mkdir()
    with pytest.raises(DataError, match=r"days: is a directory; name its TSV files"):
        convert_criteo([str(tmp_path / "days")], str(tmp_path / "out"))
    with pytest.raises(UserError, match="max_ind_range"):
        convert_criteo([], str(tmp_path / "out"), max_ind_range=1)
