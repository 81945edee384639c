"""`dlrm convert-criteo` as a user meets it: vocabulary ids, the train/eval split, a
run on the result, and `dlrm plan` with the published Criteo table sizes.

The references are plain Python over the TSV lines (a Counter per column), and the
published size lists copied from their sources (cited in the configs' comments).
The real Criteo samples stay in the shared folder; tests needing them skip without it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.criteo import convert_criteo
from data.criteo_dataset import convert_criteo_dataset, in_day_order
from dlrm.cli import main
from tests.test_criteo import HEAD10K, PADDLE, needs_shared

ROOT = Path(__file__).resolve().parents[1]
CATS = [f"C{i}" for i in range(1, 27)]
# facebookresearch/dlrm tools/visualize.py, ln_emb (see the configs' comments).
KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
          27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
MLPERF_1TB_40M = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546,
                  403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984,
                  585935, 12972, 108, 36]


def _reference_ids(train_lines: list[str], lines: list[str], min_frequency: int
                   ) -> np.ndarray:
    """[len(lines), 26] ids the obvious way: count each hex value over the train lines;
    empty → 0, kept → 2 + rank by (falling count, value), else 1."""
    fields = [x.rstrip("\n").split("\t")[14:] for x in train_lines]
    out = np.zeros((len(lines), 26), dtype=np.int64)
    rows = [x.rstrip("\n").split("\t")[14:] for x in lines]
    for j in range(26):
        counts = Counter(f[j] for f in fields if f[j])
        kept = sorted((v for v, n in counts.items() if n >= min_frequency),
                      key=lambda v: (-counts[v], int(v, 16)))
        rank = {v: 2 + r for r, v in enumerate(kept)}
        out[:, j] = [rank.get(r[j], 1) if r[j] else 0 for r in rows]
    return out


def _ids(path: Path) -> np.ndarray:
    t = pq.read_table(path)
    return np.stack([t.column(c).to_numpy() for c in CATS], axis=1)


@needs_shared
def test_vocabulary_ids_and_fraction_split_match_python(tmp_path: Path) -> None:
    lines = HEAD10K.read_text().splitlines(keepends=True)
    s = convert_criteo_dataset([str(HEAD10K)], str(tmp_path), min_frequency=2,
                               eval_fraction=0.1, row_group_rows=700, file_rows=3000)
    assert s["sets"]["train"]["rows"] == 9000 and s["sets"]["eval"]["rows"] == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["criteo.json", "eval", "train"]
    assert json.loads((tmp_path / "criteo.json").read_text()) == s
    train, test = lines[:9000], lines[9000:]
    np.testing.assert_array_equal(_ids(tmp_path / "train"), _reference_ids(train, train, 2))
    want_eval = _reference_ids(train, test, 2)
    np.testing.assert_array_equal(_ids(tmp_path / "eval"), want_eval)
    assert (want_eval == 1).any()  # unseen eval values do occur, and share the OOV id
    for j, c in enumerate(CATS):
        kept = sum(n >= 2 for n in Counter(x.split("\t")[14 + j].strip() for x in train
                                           if x.split("\t")[14 + j].strip()).values())
        assert s["table_rows"][c] == kept + 2, c
    # label and dense are what the plain converter writes, in the same order
    raw = pq.read_table(convert_criteo([str(HEAD10K)], str(tmp_path / "raw"))[0])
    for name, part in (("train", raw.slice(0, 9000)), ("eval", raw.slice(9000))):
        got = pq.read_table(tmp_path / name)
        assert got.drop_columns(CATS).equals(part.drop_columns(CATS))


@needs_shared
def test_day_split_keeps_the_last_inputs_for_eval(tmp_path: Path) -> None:
    s = convert_criteo_dataset([str(PADDLE), str(HEAD10K)], str(tmp_path / "h"), ids="hash",
                               max_ind_range=1000, eval_days=1)
    assert (s["sets"]["train"]["rows"], s["sets"]["eval"]["rows"]) == (100, 10_000)
    for name, src in (("train", PADDLE), ("eval", HEAD10K)):
        alone = pq.read_table(convert_criteo([str(src)], str(tmp_path / f"a{name}"), 1000)[0])
        assert pq.read_table(tmp_path / "h" / name).equals(alone)
    s = convert_criteo_dataset([str(HEAD10K), str(PADDLE)], str(tmp_path / "v"), eval_days=1)
    head, paddle = (p.read_text().splitlines(keepends=True) for p in (HEAD10K, PADDLE))
    np.testing.assert_array_equal(_ids(tmp_path / "v" / "eval"), _reference_ids(head, paddle, 1))
    assert max(s["table_rows"].values()) < 10_000  # distinct values, not 32-bit hashes


@pytest.mark.parametrize("flags,words", [
    (["--eval-days", "1"], "--eval-days 1 must leave one of the 1 input(s)"),
    (["--eval-fraction", "1.5"], "--eval-fraction 1.5 must be in [0, 1)"),
    (["--ids", "hash"], "--ids hash needs --max-ind-range"),
    (["--ids", "raw", "--max-ind-range", "100"], "--max-ind-range goes with --ids hash"),
    (["--eval-days", "1", "--eval-fraction", "0.1"], "not both"),
    (["--min-frequency", "0"], "--min-frequency 0 must be >= 1"),
    (["--eval-fraction", "0.00001"], "the split leaves 2 train and 0 eval rows of 2"),
])
def test_bad_arguments_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    flags: list[str], words: str) -> None:
    src = tmp_path / "day_0"
    src.write_text(("0" + "\t1" * 13 + "\tab" * 26 + "\n") * 2)
    assert main(["convert-criteo", str(src), "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dlrm convert-criteo: error: ") and "\n" not in err, err
    assert words in err, err
    assert not (tmp_path / "out" / ".staging").exists()


def test_a_shell_glob_of_days_holds_out_the_last_day(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``convert-criteo day_* --eval-days 1``: the shell sorts day_10 before day_2, so
    the last input was day_9 and the held-out day was not the last. Each day's rows
    carry the day's number in I1 (written as log1p), which tells which day was held out."""
    days = range(12)
    for day in days:
        (tmp_path / f"day_{day}").write_text(("1\t" + f"{day}" + "\t1" * 12 + "\tab" * 26 + "\n") * 3)
    shell_order = sorted(str(tmp_path / f"day_{d}") for d in days)  # what bash hands us
    assert shell_order[-1].endswith("day_9")
    out = tmp_path / "out"
    assert main(["convert-criteo", *shell_order, "--out", str(out), "--eval-days", "1",
                 "--ids", "hash", "--max-ind-range", "100", "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "inputs taken in day order (day_0, ..., day_11)" in err and "holds out day_11" in err, err
    held_out = pq.read_table(out / "eval").column("I1").to_numpy()
    np.testing.assert_allclose(held_out, np.log1p(11.0), rtol=1e-6)
    trained = np.unique(np.round(np.expm1(pq.read_table(out / "train").column("I1").to_numpy())))
    assert trained.tolist() == list(range(11))
    # an order the user chose (not the text order) is kept, and the held-out input named
    mine = [str(tmp_path / f"day_{d}") for d in (3, 1, 2)]
    assert main(["convert-criteo", *mine, "--out", str(tmp_path / "o2"), "--eval-days", "1",
                 "--ids", "hash", "--max-ind-range", "100", "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "day order" not in err and "holds out day_2" in err, err


def test_a_glob_of_gz_days_in_a_utf8_locales_order_is_put_in_day_order() -> None:
    """bash lists ``day_*.gz`` under en_US.UTF-8 (glibc's collation passes over '_' and
    '.' first, and a digit sorts before a letter) as below: not byte order, so the list
    was taken as the user's own and ``--eval-days 1`` held out day_9.gz, not day_23.gz."""
    listed = [f"/data/day_{d}.gz" for d in (0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 1, 20, 21, 22, 23,
                                            2, 3, 4, 5, 6, 7, 8, 9)]
    assert listed != sorted(listed)
    ordered, note = in_day_order(listed)
    assert ordered == [f"/data/day_{d}.gz" for d in range(24)] and note is not None
    assert in_day_order(listed[::-1]) == (listed[::-1], None)  # the user's own order is kept


@needs_shared
@pytest.mark.slow
def test_convert_train_eval_with_small_tables(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """No range flag: the converter's vocabulary gives tables of at most a few thousand
    rows instead of 2^32 (--ids raw, where dlrm train fits the vocabulary, is planned
    in test_plan_sizes_raw_hashed_ids_as_training_will).

    AUC floor 0.70: on this split (rows 9001-10000 of Kaggle's day 1 held out)
    scikit-learn's logistic regression reaches 0.721 on the 13 log1p dense features
    alone and 0.755 with the categoricals one-hot (best of C in 0.03-1); this small
    DLRM measured 0.725 (0.731 at twice the steps, with the raw ids and dlrm train's
    vocabulary too). 0.70 says it learned the dense signal at least, with room for
    thread-order noise."""
    out = tmp_path / "criteo"
    assert main(["convert-criteo", str(HEAD10K), "--out", str(out), "--eval-fraction", "0.1",
                 "--min-frequency", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    run = tmp_path / "run"
    assert main(["train", "--config", str(ROOT / "configs/criteo_kaggle.yaml"), "--out", str(run),
                 f"data.train={out / 'train'}", f"data.eval={out / 'eval'}",
                 "data.batch_size=256", "optim.dense=adagrad", "optim.sparse=rowwise_adagrad",
                 "optim.dense_lr=0.02", "optim.sparse_lr=0.04", "model.embedding_dim=8",
                 "model.bottom_mlp=[32,8]", "model.top_mlp=[32,1]", "train.epochs=2",
                 "train.progress=false"]) == 0
    rows = {f["name"]: f["rows"] for f in json.loads((run / "schema.json").read_text())["sparse"]}
    assert rows == summary["table_rows"] and max(rows.values()) < 2000, rows
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(out / "eval")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 1000 and result["auc"] > 0.70, result


def _planned_rows(text: str) -> list[int]:
    return [int(m.group(2).replace(",", ""))
            for m in re.finditer(r"^(C\d+)\s+([\d,]+)x\d+", text, re.MULTILINE)]


@pytest.mark.parametrize("config,sizes,source", [
    ("criteo_1tb.yaml", MLPERF_1TB_40M, "MLPerf"),
    ("criteo_kaggle.yaml", KAGGLE, "Kaggle"),
])
def test_plan_without_data_uses_and_names_published_sizes(
        capsys: pytest.CaptureFixture[str], config: str, sizes: list[int], source: str) -> None:
    assert main(["plan", "--config", str(ROOT / "configs" / config), "--world-size", "8"]) == 0
    text = capsys.readouterr().out
    first = text.splitlines()[0]
    assert first.startswith("table sizes: no data given") and source in first, first
    assert f"{sum(sizes):,} rows" in first and "facebookresearch/dlrm" in first
    assert _planned_rows(text) == sizes


def test_plan_says_when_sizes_are_synthetic_or_from_data(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(ROOT / "configs/tiny.yaml")
    assert main(["plan", "--config", tiny, "--world-size", "2"]) == 0
    assert "synthetic" in capsys.readouterr().out.splitlines()[0]
    src = tmp_path / "day_0"
    src.write_text("".join(f"{i % 2}" + "\t1" * 13 + f"\t{i:x}" * 26 + "\n" for i in range(50)))
    assert main(["convert-criteo", str(src), "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    assert main(["plan", "--config", tiny, "--world-size", "2",
                 "--data", str(tmp_path / "d")]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith(f"table sizes: from the data {tmp_path / 'd'}")
    assert _planned_rows(text) == [50 + 2] * 26  # 50 values once each, the empty and OOV ids


def test_plan_sizes_raw_hashed_ids_as_training_will(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ids raw keeps 32-bit hashes; the plan, like dlrm train, sizes by the vocabulary
    (50 values + its out-of-vocabulary row 0), not by max id + 1 (about 2e9 here)."""
    src = tmp_path / "day_0"
    src.write_text("".join(f"{i % 2}" + "\t1" * 13 + f"\t{i * 40_000_000 + 7:x}" * 26 + "\n"
                           for i in range(50)))
    assert main(["convert-criteo", str(src), "--out", str(tmp_path / "d"), "--ids", "raw"]) == 0
    assert pq.read_table(tmp_path / "d" / "part-00000.parquet").column("C1").to_numpy().max() > 1_900_000_000
    capsys.readouterr()
    assert main(["plan", "--config", str(ROOT / "configs/tiny.yaml"), "--world-size", "2",
                 "--data", str(tmp_path / "d")]) == 0
    assert _planned_rows(capsys.readouterr().out) == [50 + 1] * 26
