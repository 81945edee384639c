"""The count-min sketch pre-filter: its estimate never falls below the true count
(reference: collections.Counter), so every value reaching min_frequency survives,
and it does drop most of a long tail (else it would save no memory)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa

from data.fit_sketch import Sketch


def test_sketch_overestimates_and_drops_the_tail() -> None:
    rng = np.random.default_rng(3)
    ints = (rng.zipf(1.3, 60_000) * 7919 + (1 << 33)).astype(np.int64)
    words = pa.array([f"w{x}" for x in rng.zipf(1.5, 20_000)])
    sk = Sketch(Sketch.width_for(80_000), {"a", "b"})
    half = Sketch(sk.width)  # merged from two halves: the same counters
    sk.add("a", pa.array(ints)).add("b", words)
    half.add("a", pa.array(ints[:30_000])).add(Sketch(sk.width).add("a", pa.array(ints[30_000:])))
    half.add("b", words)
    assert np.array_equal(sk.counts, half.counts)
    for table, values in (("a", pa.array(ints)), ("b", words)):
        true = Counter(values.to_pylist())
        for k in (2, 3, 5):
            kept = Counter(sk.survivors(table, values, k).to_pylist())
            assert all(kept[v] == c for v, c in true.items() if c >= k)  # exact survivors
            tail = [v for v, c in true.items() if c < k]
            dropped = sum(1 for v in tail if v not in kept)
            assert dropped >= 0.8 * len(tail), (table, k, dropped, len(tail))


def test_progress_bar_counts_the_footers_rows(tmp_path) -> None:
    """The pass's bar: total from the footers (reference: pyarrow's own row count),
    and the split pass's bar advances by exactly the rows counted."""
    import pyarrow.parquet as pq

    from data import fit_split, preprocess
    from data.schema import infer_schema
    from tests.test_fit_split import _files

    files = _files(tmp_path)
    total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    bar = preprocess._bar(files, True)
    assert bar.total == total
    bar.close()
    assert preprocess._bar(files, False) is None
    seen = []
    orig = fit_split._bar

    def spy(t, what, on):  # shown (not a terminal here), into a buffer
        import io

        from tqdm import tqdm

        assert orig(t, what, on) is not None and on
        seen.append(tqdm(total=t, file=io.StringIO(), disable=False))
        return seen[-1]

    fit_split._bar = spy
    try:
        schema = infer_schema(files)
        fit_split.count_split(files, schema, {f.table_name for f in schema.sparse}, False,
                              fit_split.Split(progress=True))
    finally:
        fit_split._bar = orig
    assert [(b.total, b.n) for b in seen] == [(total, total)]
