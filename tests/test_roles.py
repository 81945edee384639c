"""Columns' roles recorded in the footer by our writers (data/roles.py): files from
``dlrm generate`` and ``dlrm convert-criteo`` train without the "integer columns taken as
sparse" warning, a declared role is followed where the type allows it, and a file
without the entry (or with a damaged one) is inferred as before. References: the
generator's own Schema, Criteo's column names, and ``infer_schema`` given the same
split explicitly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.criteo_dataset import convert_criteo_dataset
from data.generate import GenerateConfig, generate_dataset, generator_schema
from data.roles import ROLES_KEY, Roles, declared_roles, with_roles
from data.schema import CRITEO_DENSE, CRITEO_SPARSE, infer_schema
from dlrm.config import load_config
from dlrm.train.header import header, integer_warning
from tests.conftest import TINY

N = 200


def _user_table() -> pa.Table:
    rng = np.random.default_rng(0)
    return pa.table({
        "label": rng.integers(0, 2, N).astype(np.float32),
        "spend": rng.random(N).astype(np.float32),
        "clicks_7d": rng.integers(0, 42, N),
        "age": rng.integers(18, 80, N),
        "user_id": rng.integers(0, 300, N),
        "city": [f"c{i}" for i in rng.integers(0, 20, N)],
    })


def _write(path: Path, table: pa.Table, roles: Roles | None) -> str:
    schema = with_roles(table.schema, roles) if roles else table.schema
    pq.write_table(table.cast(schema), path)
    return str(path)


def _without_roles(path: str, out: Path) -> str:
    """The same data rewritten with its metadata dropped (pandas, Spark, a user's copy)."""
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata(None), out)
    return str(out)


def test_a_declared_role_is_followed_and_the_rest_inferred(tmp_path: Path) -> None:
    """clicks_7d is an int declared dense; age is an undeclared int (inferred sparse, still
    warned about); the result equals infer_schema told the same split."""
    roles = Roles("label", ("spend", "clicks_7d"), ("user_id", "city"), "a test")
    path = _write(tmp_path / "f.parquet", _user_table(), roles)
    declared = infer_schema([path])
    told = infer_schema([path], dense=["spend", "clicks_7d"])
    assert declared == told
    assert declared.dense == ("spend", "clicks_7d")
    assert [f.name for f in declared.sparse] == ["age", "user_id", "city"]
    line = integer_warning(load_config(TINY, []), declared, path)
    assert line is not None and ": age;" in line  # the declared id is not named


def test_a_role_the_type_cannot_take_is_inferred_by_type(tmp_path: Path) -> None:
    roles = Roles("label", ("city",), ("spend",), "a test")  # a string dense, a float sparse
    path = _write(tmp_path / "f.parquet", _user_table(), roles)
    plain = _write(tmp_path / "g.parquet", _user_table(), None)
    assert infer_schema([path]) == infer_schema([plain])


def test_a_damaged_entry_is_inferred_as_without_one(tmp_path: Path) -> None:
    table = _user_table()
    plain = _write(tmp_path / "plain.parquet", table, None)
    for i, raw in enumerate([b"not json", b'{"dense": 3}', b'{"label": "label", "dense": [1], "sparse": []}']):
        path = tmp_path / f"bad{i}.parquet"
        pq.write_table(table.replace_schema_metadata({ROLES_KEY: raw}), path)
        assert declared_roles(pq.read_schema(path)) is None
        assert infer_schema([str(path)]) == infer_schema([plain])


def test_generated_files_declare_the_generators_schema(tmp_path: Path) -> None:
    cfg = GenerateConfig(rows=N, sparse=6, multi_hot=2, dense=3, table_rows=[50], row_group_rows=64)
    files = generate_dataset(str(tmp_path / "gen"), cfg, seed=1)
    reference = generator_schema(cfg)
    inferred = infer_schema(files)
    assert inferred.dense == reference.dense
    assert [f.name for f in inferred.sparse] == [f.name for f in reference.sparse]
    assert integer_warning(load_config(TINY, []), inferred, files[0]) is None
    copy = _without_roles(files[0], tmp_path / "copy.parquet")  # the entry is what silences it
    assert integer_warning(load_config(TINY, []), infer_schema([copy]), copy) is not None


def test_converted_criteo_declares_its_columns_and_trains_without_the_warning(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    lines = ["\t".join([str(rng.integers(0, 2))] + [str(rng.integers(0, 9)) for _ in CRITEO_DENSE]
                       + [f"{rng.integers(0, 40):08x}" for _ in CRITEO_SPARSE]) for _ in range(N)]
    tsv = tmp_path / "day_0.tsv"
    tsv.write_text("\n".join(lines) + "\n")
    for workers in (1, 2):  # one process, and the pool's per-part writers
        out = tmp_path / f"out{workers}"
        convert_criteo_dataset([str(tsv)], str(out), eval_fraction=0.25, workers=workers)
        for part in ("train", "eval"):
            (path,) = [str(p) for p in sorted((out / part).glob("*.parquet"))]
            roles = declared_roles(pq.read_schema(path))
            assert roles == Roles("label", CRITEO_DENSE, CRITEO_SPARSE, "dlrm convert-criteo")
    path = str(next((tmp_path / "out2" / "train").glob("*.parquet")))
    cfg = load_config(TINY, [])
    schema = infer_schema([path])
    assert schema.dense == CRITEO_DENSE and [f.name for f in schema.sparse] == list(CRITEO_SPARSE)
    lines = header(cfg, schema, [path], [], None, "cpu", tmp_path / "run")
    assert not any(line.startswith("warning:") for line in lines)
    assert any("as the files declare (written by dlrm convert-criteo)" in line for line in lines)


def test_columns_not_in_their_declared_role_are_named_in_one_warning(tmp_path: Path) -> None:
    """A file changed after our writer declared its roles (a column cast, one dropped)
    keeps the declaration: the header names each column trained otherwise, and why,
    and the schema line no longer says "as the files declare" alone. The reference is
    the declaration itself against what ``infer_schema`` made of the file."""
    table = _user_table().drop(["age"])  # declared below, gone from the file
    roles = Roles("label", ("spend", "city"), ("user_id", "clicks_7d", "age"), "dlrm convert-criteo")
    table = table.set_column(table.schema.get_field_index("clicks_7d"), "clicks_7d",
                             table["clicks_7d"].cast(pa.float64()))
    path = _write(tmp_path / "f.parquet", table, roles)
    schema = infer_schema([path])
    assert "city" in [f.name for f in schema.sparse] and "clicks_7d" in schema.dense  # trained by type
    lines = header(load_config(TINY, []), schema, [path], [], None, "cpu", tmp_path / "run")
    (warning,) = [line for line in lines if line.startswith("warning: columns not in the role")]
    assert ("city (declared dense, string: trained as sparse), clicks_7d (declared sparse, double: trained as "
            "dense), age (declared sparse, missing from f.parquet)") in warning, warning
    (schema_line,) = [line for line in lines if line.startswith("schema")]
    assert schema_line.endswith("as the files declare (written by dlrm convert-criteo), but for 3 columns "
                                "(the warning above)"), schema_line
    # naming the roles is the way to say the change was meant: no warning
    told = load_config(TINY, ["data.dense=[spend,clicks_7d]", "data.sparse=[user_id,city]"])
    told_schema = infer_schema([path], dense=["spend", "clicks_7d"], sparse=["user_id", "city"])
    assert not any(line.startswith("warning: columns not in the role")
                   for line in header(told, told_schema, [path], [], None, "cpu", tmp_path / "run"))
