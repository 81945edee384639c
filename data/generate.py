"""Synthetic Criteo-like data: Zipf-popular ids and a planted logistic signal.

Written as Parquet, streamed in row groups, seeded and reproducible.

    label    float32 0/1 ~ Bernoulli(sigmoid(logit)), CTR about 0.25
    I1..Id   float32 log1p(count), count = floor(exp(mu_j + sd_j * z_j)), z_j ~ N(0, 1)
    C1..Cs   int64 ids, Zipf(cfg.zipf) over the table's rows, hot ids scattered by a
             fixed permutation; the last ``cfg.multi_hot`` are list<int64> bags of
             0..max_bag ids
    logit    = bias + signal * (c_d * w.z + c_s / sqrt(s) * sum_f effect_f(id))

The hidden model (mu, sd, w, the per-(table, id) effects, the permutations) comes
from the fixed ``MODEL_SEED`` alone, so sets generated with different ``seed`` share
it: a model trained on one generalises to the other. ``seed`` changes only the
sampled rows. Effects are a hash of (table, id), so no table is ever held in memory;
each table's effects are standardised over its Zipf distribution, and ``SIGMA`` puts
the Bayes-optimal AUC near 0.80 at ``signal=1``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from data.errors import UserError
from data.schema import Schema, SparseFeature

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa


@dataclass
class GenerateConfig:
    """Synthetic Criteo-like data for ``dlrm generate``."""

    rows: int = 100_000
    dense: int = 13
    sparse: int = 26
    table_rows: list[int] = field(default_factory=lambda: [1000])  # one value, or one per table
    # Where table_rows come from (a dataset's published sizes): `dlrm plan` without
    # data plans with table_rows and names this; empty = synthetic sizes.
    table_rows_source: str = ""
    zipf: float = 1.05  # id popularity exponent (Criteo is about 1.05)
    multi_hot: int = 0  # how many of the sparse features are multi-hot bags
    max_bag: int = 5  # multi-hot bag lengths are uniform in [0, max_bag]
    signal: float = 1.0  # strength of the planted logistic signal
    row_group_rows: int = 65_536
    file_rows: int = 1_000_000


MODEL_SEED = 12345  # the hidden model's seed: fixed, shared by every generated set
SIGMA = 1.4  # logit standard deviation at signal=1 (Bayes AUC about 0.80)
DENSE_SHARE = 0.3  # fraction of the logit variance carried by the dense features
CTR = 0.25
_ZIPF_HEAD = 1 << 20  # ranks with an exact CDF; beyond, a continuous approximation


def generator_schema(cfg: GenerateConfig) -> Schema:
    """The Schema of what :func:`generate_dataset` writes for ``cfg``."""
    rows = _table_rows(cfg)
    first_bag = cfg.sparse - cfg.multi_hot
    return Schema(
        label="label",
        dense=tuple(f"I{j + 1}" for j in range(cfg.dense)),
        sparse=tuple(
            SparseFeature(name=f"C{t + 1}", rows=rows[t], multi_hot=t >= first_bag)
            for t in range(cfg.sparse)
        ),
    )


def generate_dataset(
    out_dir: str, cfg: GenerateConfig, seed: int = 0, rows: int | None = None
) -> list[str]:
    """Write ``rows`` (default ``cfg.rows``) synthetic rows under ``out_dir``; return the files.

    Files are ``part-00000.parquet, ...`` of ``cfg.file_rows`` rows in row groups of
    ``cfg.row_group_rows``; memory holds one row group. Chunk g of the rows is drawn
    from RNG(seed, g), so the same (cfg, seed, rows) gives identical files.
    """
    import numpy as np
    import pyarrow as pa

    from data.files import write_parts
    from data.roles import Roles, with_roles

    n = cfg.rows if rows is None else rows
    if n < 0 or seed < 0:
        raise UserError(f"generate: rows {n} and seed {seed} must be >= 0")
    model = _HiddenModel(cfg)
    schema = generator_schema(cfg)
    arrow = with_roles(pa.schema(
        [("label", pa.float32())]
        + [(d, pa.float32()) for d in schema.dense]
        + [(f.name, pa.list_(pa.int64()) if f.multi_hot else pa.int64()) for f in schema.sparse]
    ), Roles("label", schema.dense, tuple(f.name for f in schema.sparse), "dlrm generate"))

    def chunks() -> Iterator[pa.Table]:
        for g, start in enumerate(range(0, n, cfg.row_group_rows)):
            size = min(cfg.row_group_rows, n - start)
            yield model.sample(np.random.default_rng([seed, g]), size, arrow)

    return write_parts(out_dir, chunks(), arrow, cfg.file_rows, cfg.row_group_rows)


def _table_rows(cfg: GenerateConfig) -> list[int]:
    """Rows of each table; also checks the config (a UserError names the bad key)."""
    rows = list(cfg.table_rows)
    if len(rows) == 1:
        rows = rows * cfg.sparse
    checks = [
        (len(rows) == cfg.sparse, f"table_rows has {len(rows)} values for {cfg.sparse} tables"),
        (all(1 <= r <= 2**32 for r in rows), f"table_rows {cfg.table_rows} not in [1, 2^32]"),
        (cfg.dense >= 0 and cfg.sparse >= 0, "dense and sparse must be >= 0"),
        (0 <= cfg.multi_hot <= cfg.sparse, f"multi_hot {cfg.multi_hot} not in [0, sparse]"),
        (cfg.max_bag >= 0 and cfg.zipf >= 0, "max_bag and zipf must be >= 0"),
        (cfg.row_group_rows >= 1 and cfg.file_rows >= 1, "row_group_rows, file_rows must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(f"generate: {message}")
    return rows


# --------------------------------------------------------------------------- hidden model


class _Zipf:
    """Ranks 0..n-1 with P(r) ∝ (r + 1)^-s, by inverse CDF.

    The first ``_ZIPF_HEAD`` ranks use the exact discrete CDF; the tail of larger
    tables uses the continuous integral of x^-s, which is very close there.
    """

    def __init__(self, n: int, s: float) -> None:
        import numpy as np

        self.n, self.s = n, s
        self.k = min(n, _ZIPF_HEAD)
        weights = np.arange(1, self.k + 1, dtype=np.float64) ** -s
        tail = self._integral(self.k + 0.5, n + 0.5) if n > self.k else 0.0
        total = weights.sum() + tail
        self.head_p = weights / total  # [k] exact probabilities of the head ranks
        self.cdf = np.cumsum(self.head_p)
        self.head_mass = float(self.cdf[-1]) if n > self.k else 1.0
        self.tail = tail

    def _integral(self, a: float, b: float) -> float:
        if abs(self.s - 1.0) < 1e-12:
            return math.log(b / a)
        return (b ** (1 - self.s) - a ** (1 - self.s)) / (1 - self.s)

    def ranks(self, u: np.ndarray) -> np.ndarray:
        """Ranks [m] int64 for uniforms ``u`` [m] in [0, 1)."""
        import numpy as np

        r = np.minimum(np.searchsorted(self.cdf, u, side="right"), self.k - 1)
        if self.n > self.k:
            in_tail = u >= self.head_mass
            v = (u[in_tail] - self.head_mass) / (1 - self.head_mass) * self.tail
            a = self.k + 0.5
            if abs(self.s - 1.0) < 1e-12:
                x = a * np.exp(v)
            else:
                x = (a ** (1 - self.s) + v * (1 - self.s)) ** (1 / (1 - self.s))
            r[in_tail] = np.clip(np.floor(x + 0.5).astype(np.int64), self.k + 1, self.n) - 1
        return r.astype(np.int64)


@dataclass
class _Table:
    """One table's id distribution and effects: id = (a * rank + c) mod n."""

    index: int
    zipf: _Zipf
    a: int
    c: int
    key: int  # hash key of the table's effects
    mean: float = 0.0
    std: float = 1.0

    def ids(self, ranks: np.ndarray) -> np.ndarray:
        import numpy as np

        n = np.uint64(self.zipf.n)
        r = ranks.astype(np.uint64)
        return (((np.uint64(self.a) * r) % n + np.uint64(self.c)) % n).astype(np.int64)

    def effects(self, ids: np.ndarray) -> np.ndarray:
        """Standardised effect of each id [m]: a normal drawn by hashing (table, id)."""
        import numpy as np

        from data.hashing import splitmix64

        h = splitmix64(ids.astype(np.uint64) ^ np.uint64(self.key))
        u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) / 2.0**32
        u2 = ((h & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) / 2.0**32
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        return (z - self.mean) / self.std


class _HiddenModel:
    """Everything fixed by ``MODEL_SEED`` and the config's shape; samples rows."""

    def __init__(self, cfg: GenerateConfig) -> None:
        import numpy as np

        from data.hashing import splitmix64

        self.cfg = cfg
        rows = _table_rows(cfg)
        rng = np.random.default_rng(MODEL_SEED)
        d = cfg.dense
        self.mu = rng.uniform(0.5, 4.0, d)
        self.sd = rng.uniform(0.7, 1.5, d)
        w = rng.normal(size=d) * (rng.random(d) < 0.7)  # about 70% of them informative
        self.w = w / np.linalg.norm(w) if np.any(w) else w
        share = DENSE_SHARE if d and cfg.sparse else (1.0 if d else 0.0)
        self.c_dense = SIGMA * math.sqrt(share) if np.any(w) else 0.0
        self.c_sparse = SIGMA * math.sqrt(1 - share)
        sigma = cfg.signal * math.hypot(self.c_dense, self.c_sparse if cfg.sparse else 0.0)
        self.bias = math.log(CTR / (1 - CTR)) * math.sqrt(1 + math.pi * sigma**2 / 8)
        keys = splitmix64(np.arange(cfg.sparse, dtype=np.uint64) + np.uint64(MODEL_SEED << 20))
        self.tables = []
        zipfs: dict[int, _Zipf] = {}
        for t, n in enumerate(rows):
            zipf = zipfs.setdefault(n, _Zipf(n, cfg.zipf))
            a = max(1, round(n * 0.6180339887498949))
            while math.gcd(a, n) != 1:
                a += 1
            table = _Table(t, zipf, a % n or 1, int(keys[t] % np.uint64(n)), int(keys[t]))
            head = table.effects(table.ids(np.arange(zipf.k)))
            p = zipf.head_p / zipf.head_p.sum()
            table.mean = float(p @ head)
            table.std = float(np.sqrt(max(p @ (head - table.mean) ** 2, 1e-12)))
            self.tables.append(table)
        self.first_bag = cfg.sparse - cfg.multi_hot

    def sample(self, rng: np.random.Generator, n: int, arrow: pa.Schema) -> pa.Table:
        """``n`` rows drawn with ``rng`` as an Arrow table of schema ``arrow``."""
        import numpy as np
        import pyarrow as pa

        cfg = self.cfg
        z = rng.standard_normal((n, cfg.dense))
        counts = np.floor(np.exp(self.mu + self.sd * z))
        cols: dict[str, pa.Array] = {}
        for j in range(cfg.dense):
            cols[f"I{j + 1}"] = pa.array(np.log1p(counts[:, j]).astype(np.float32))
        sparse_sum = np.zeros(n)
        for t, table in enumerate(self.tables):
            if t < self.first_bag:
                ids = table.ids(table.zipf.ranks(rng.random(n)))
                sparse_sum += table.effects(ids)
                cols[f"C{t + 1}"] = pa.array(ids)
                continue
            lengths = rng.integers(0, cfg.max_bag + 1, n)
            ids = table.ids(table.zipf.ranks(rng.random(int(lengths.sum()))))
            owner = np.repeat(np.arange(n), lengths)
            bag = np.bincount(owner, weights=table.effects(ids), minlength=n)
            sparse_sum += bag / np.maximum(lengths, 1)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            cols[f"C{t + 1}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
        logit = self.bias + cfg.signal * (
            self.c_dense * (z @ self.w) + self.c_sparse * sparse_sum / math.sqrt(max(cfg.sparse, 1))
        )
        p = 1.0 / (1.0 + np.exp(-logit))
        label = (rng.random(n) < p).astype(np.float32)
        return pa.table({"label": pa.array(label), **cols}).cast(arrow)
