"""encoding=auto decided cheaply: dense pre-hashed ids past 2^20 are settled from the
footers and a sample of row groups (counted: no more row groups read than the sample),
sparse hashed ids still get the full pass's vocabulary (reference: the vocabulary
fitted with data.encoding=vocabulary over the same file), and the notes say per table
what was decided and from what."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import preprocess
from data.schema import infer_schema


def _reads(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = pq.ParquetFile.read_row_group

    def counted(self, i, *a, **k):
        calls.append(i)
        return real(self, i, *a, **k)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    return calls


def test_dense_prehashed_ids_read_only_the_sample(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(preprocess, "SAMPLE_ROWS", 3000)
    monkeypatch.setattr(preprocess, "AUTO_IDENTITY_ROWS", 1000)  # 2^20 scaled down
    rng = np.random.default_rng(0)
    n, space = 60_000, 40_000  # ids dense in [0, 40000): past the bound, rows enough to fill
    ids = rng.integers(0, space, n)
    ids[:2] = [0, space - 1]
    assert 2 * len(np.unique(ids)) >= space  # what the full pass would find: identity
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": np.zeros(n, np.float32), "C": ids}), path, row_group_size=1000)
    schema = infer_schema([str(path)])
    reads = _reads(monkeypatch)
    prep = preprocess.fit([str(path)], schema, preprocess.Options())
    assert prep.encodings["C"] == "identity"
    assert len(reads) == 3  # 3000 sample rows / 1000 per group; 60 groups in the file
    assert len(set(reads)) == 3 and max(reads) > 30  # spread over the file
    assert any("table C identity (sample of 3000 rows in 3 row groups" in x for x in prep.notes)


def test_sparse_hashed_ids_still_get_the_full_vocabulary(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(preprocess, "SAMPLE_ROWS", 3000)
    monkeypatch.setattr(preprocess, "AUTO_IDENTITY_ROWS", 1000)
    rng = np.random.default_rng(1)
    n = 60_000
    ids = rng.zipf(1.3, n) % 500 * 97 + 2000  # < 500 distinct up to ~50000: sampled
    hashed = rng.integers(0, 1 << 40, n)  # past 2 x rows: settled by the footers
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"label": np.zeros(n, np.float32), "C": ids, "H": hashed}), path,
                   row_group_size=1000)
    schema = infer_schema([str(path)])
    prep = preprocess.fit([str(path)], schema, preprocess.Options())
    ref = preprocess.fit([str(path)], schema, preprocess.Options(encoding="vocabulary"))
    for t in ("C", "H"):
        assert prep.encodings[t] == "vocabulary"
        assert prep.vocabularies[t].values.equals(ref.vocabularies[t].values)
    notes = "\n".join(prep.notes)
    assert "table H vocabulary (footers: 60000 rows < half of max id + 1" in notes
    assert "table C vocabulary (sample of 3000 rows in 3 row groups" in notes
