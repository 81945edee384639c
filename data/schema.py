"""What the columns of a dataset mean: label, dense features, sparse features.

A sparse feature is a categorical column: int, string, binary or dictionary (one value
per row, "single-hot") or a list of those (a bag, "multi-hot"); each feeds one
embedding table of ``rows`` rows. Its ``encoding`` says how a value becomes a row
(identity: the int id is the row; vocabulary, hash: see :mod:`data.preprocess`).
Default layout is Criteo's ``label, I1..I13, C1..C26``.

``infer_schema`` builds a Schema from Parquet footers (column types, and each
table's rows as max id + 1 from the row-group statistics); ``check_files``
checks a list of files against a Schema before anything reads them. Both import
pyarrow only when called, so importing this module stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from data.bad_data import BadRecord
from data.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True)
class SparseFeature:
    """One sparse column and the embedding table that serves it."""

    name: str
    rows: int
    table: str = ""  # table name; empty means "same as the column name"
    multi_hot: bool = False
    encoding: str = "identity"  # identity | vocabulary | hash (data/preprocess.py)

    @property
    def table_name(self) -> str:
        return self.table or self.name


@dataclass(frozen=True)
class Schema:
    label: str = "label"
    dense: tuple[str, ...] = ()
    sparse: tuple[SparseFeature, ...] = field(default_factory=tuple)

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.sparse_names]


CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))


# --------------------------------------------------------------------------- Parquet footers

_FLOAT, _INT, _INT_LIST = "float", "int", "list<int>"
_CAT, _CAT_LIST = "category", "list<category>"  # string, binary, dictionary (vocabulary, hash)
_BOOL = "bool"  # a label or a dense 0/1 value


def column_kind(arrow_type: pa.DataType) -> str:
    """``"float"``, ``"int"``, ``"bool"``, ``"list<int>"``, ``"category"``,
    ``"list<category>"`` or ``"other"`` for an Arrow column type."""
    import pyarrow as pa

    if pa.types.is_floating(arrow_type):
        return _FLOAT
    if pa.types.is_boolean(arrow_type):
        return _BOOL
    if pa.types.is_integer(arrow_type):
        return _INT
    if _is_category(arrow_type):
        return _CAT
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        inner = column_kind(arrow_type.value_type)
        if inner in (_INT, _CAT):
            return f"list<{inner}>"
    return "other"


def _is_category(t: pa.DataType) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
            or pa.types.is_dictionary(t))


def is_categorical(arrow_type: pa.DataType) -> bool:
    """A type whose values need a vocabulary or a hash to become rows (not an int)."""
    return column_kind(arrow_type) in (_CAT, _CAT_LIST)


def exemplar(files: list[str]) -> str:
    """The file whose footer gives the dataset's columns and types: the first holding
    rows (a 0-row part pandas wrote from an empty frame types its string columns null),
    the first file if none does."""
    from data.files import footer

    for path in files:
        if footer(path).metadata.num_rows:
            return path
    return files[0]


def column_types(path: str, columns: list[str]) -> dict[str, pa.DataType]:
    """Arrow type of each of ``columns`` in a file's footer."""
    from data.files import footer

    arrow = footer(path).schema_arrow
    return {c: arrow.field(c).type for c in columns}


def type_name(arrow_type: pa.DataType) -> str:
    """A type's name without the list item's field name (``list<int64>``)."""
    import pyarrow as pa

    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return f"list<{type_name(arrow_type.value_type)}>"
    return str(arrow_type)


def value_family(arrow_type: pa.DataType, dense: bool) -> str:
    """What a column's values are once read, the same for types that store the same values
    in another width or layout: files may differ there (int32 in one, int64 in another,
    string, large_string or dictionary, a float64 label beside an int8 one). Dense columns
    and labels are all cast to float32 (one family); ids are ints, strings or bytes
    (vocabulary and hash keys differ between those), a bag the family of its items."""
    import pyarrow as pa

    if dense:
        return "number"
    t = arrow_type
    while pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{value_family(t.value_type, False)}>"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    return "binary" if _is_category(t) else type_name(t)


def allowed_kinds(schema: Schema, column: str) -> tuple[str, ...]:
    """Kinds a column may have in a file: label and dense are cast to float32."""
    for f in schema.sparse:
        if f.name == column:
            if f.encoding == "identity":
                return (_INT_LIST,) if f.multi_hot else (_INT,)
            return (_INT_LIST, _CAT_LIST) if f.multi_hot else (_INT, _CAT)
    return (_FLOAT, _INT, _BOOL)


def infer_schema(
    files: list[str],
    label: str = "label",
    dense: list[str] | None = None,
    sparse: list[str] | None = None,
    rows: dict[str, int] | None = None,
    tables: dict[str, str] | None = None,
    on_error: str = "fail",
    exclude: list[str] | None = None,
) -> Schema:
    """A Schema read from Parquet footers only (no data pages, except as noted).

    Columns come from the first file holding rows (:func:`exemplar`), in file order:
    float, bool (0/1) → dense; int, string, binary, dictionary → sparse single-hot, a list
    of those multi-hot; other types are left out (the header names them; no sparse
    feature at all is a DataError naming the columns found). Roles that our writers declare in the
    footer (data/roles.py) are followed where the type allows. String, binary and
    dictionary features get encoding "vocabulary" here and rows 1 until
    :mod:`data.preprocess` fits them. A non-empty ``dense`` or ``sparse`` list replaces
    the inference for its side (in its own order); the other side is inferred from the
    remaining columns; ``exclude`` names columns neither side takes. A table's rows are
    ``rows[feature]`` when given, else max id + 1 over the row-group statistics of every
    file (for a list, its leaf column's). Where a row group has no statistics its column
    is read to find the max (the one fallback that reads data). Features sharing a table
    (``tables``: feature → table name) get the largest of their row counts,
    explicit counts taking precedence over inferred ones.

    With ``on_error="skip"`` files that cannot be read or whose columns differ from the
    first's are left out (the reader reports them); otherwise such a file is a DataError.
    """
    from data.files import footer

    if not files:
        raise DataError("no data files to infer a schema from")
    if on_error == "skip":
        files = _readable(files)
    rows, tables = dict(rows or {}), dict(tables or {})
    source = exemplar(files)
    first = footer(source).schema_arrow
    if first.get_field_index(label) < 0:
        raise DataError("label column is missing", file=source, column=label)
    kinds = _kinds(first, label, dense, sparse, exclude, [source, *files])
    if not dense and not sparse:  # the roles our own writers recorded (data/roles.py)
        dense, sparse = _declared_sides(first, kinds)
    sparse_names = list(sparse) if sparse else _categorical_columns(first, kinds, dense, source)
    dense_names = list(dense) if dense else [
        n for n, k in kinds.items() if k in (_FLOAT, _BOOL) and n not in sparse_names
    ]
    for mapping, what in ((rows, "rows"), (tables, "tables")):
        for name in mapping:
            if name not in sparse_names:
                raise DataError(f"data.{what} names a column that is not a sparse feature",
                                column=name)
    if on_error == "skip":
        wanted = [label, *dense_names, *sparse_names]
        sparse_set = set(sparse_names)
        files = [f for f in files if _families(f, wanted, sparse_set) == _families(source, wanted, sparse_set)]
    categorical = {n for n in sparse_names if kinds[n] in (_CAT, _CAT_LIST)}
    inferred = _max_ids(files, [n for n in sparse_names if n not in rows and n not in categorical])
    inferred.update(dict.fromkeys(categorical, 0))
    table_of = {n: tables.get(n) or n for n in sparse_names}
    table_rows: dict[str, int] = {}
    for table in set(table_of.values()):
        members = [n for n in sparse_names if table_of[n] == table]
        explicit = [rows[n] for n in members if n in rows]
        table_rows[table] = max(explicit or [inferred[n] + 1 for n in members] or [1])
    return Schema(
        label=label,
        dense=tuple(dense_names),
        sparse=tuple(
            SparseFeature(
                name=n,
                rows=max(table_rows[table_of[n]], 1),
                table=tables.get(n, ""),
                multi_hot=kinds[n] in (_INT_LIST, _CAT_LIST),
                encoding="vocabulary" if n in categorical else "identity",
            )
            for n in sparse_names
        ),
    )


def _kinds(first: pa.Schema, label: str, dense: list[str] | None, sparse: list[str] | None,
           exclude: list[str] | None, files: list[str]) -> dict[str, str]:
    """Each column's kind but the label's and the excluded ones'; a DataError for a named
    column the first file lacks (saying so where it is a Hive partition key, a directory
    name), or one both excluded and named dense or sparse."""
    from data.files import hive_partitions

    kinds = {f.name: column_kind(f.type) for f in first if f.name != label}
    for key, given in (("data.dense", dense), ("data.sparse", sparse), ("data.exclude", exclude)):
        if label in (given or []):  # said "column is missing" before: the label is no feature's
            raise DataError(f"{key} names the label column (data.label); a label is neither a feature "
                            "nor left out", column=label)
    both = set(dense or []) & set(sparse or [])
    if both:  # trained as both until 2026-12-07, without a word
        raise DataError("data.dense and data.sparse both name this column; give each column one side",
                        column=min(both))
    for given in (dense or [], sparse or [], exclude or []):
        for name in given:
            if name not in kinds:
                where = hive_partitions(files).get(name)
                hint = (f" (it is a Hive partition key, only in directory names such as {where}/: "
                        "write it into the files to train on it)") if where else ""
                raise DataError(f"column is missing{hint}", file=files[0], column=name)
    for name in exclude or []:
        if name in (dense or []) or name in (sparse or []):
            raise DataError("data.exclude names a column data.dense or data.sparse takes", column=name)
        del kinds[name]
    return kinds


def _declared_sides(first: pa.Schema, kinds: dict[str, str]) -> tuple[list[str] | None, list[str] | None]:
    """Dense and sparse columns, in file order, as the file's declared roles say where a
    column's type allows its role, and by type for every other column; (None, None)
    when the file declares no roles."""
    from data.roles import declared_roles

    roles = declared_roles(first)
    if roles is None:
        return None, None
    dense_kinds, sparse_kinds = (_FLOAT, _INT, _BOOL), (_INT, _INT_LIST, _CAT, _CAT_LIST)

    def role(name: str, kind: str) -> str | None:
        if name in roles.dense and kind in dense_kinds:
            return "dense"
        if name in roles.sparse and kind in sparse_kinds:
            return "sparse"
        return "dense" if kind in (_FLOAT, _BOOL) else "sparse" if kind in sparse_kinds else None

    sides = {n: role(n, k) for n, k in kinds.items()}
    return ([n for n, r in sides.items() if r == "dense"],
            [n for n, r in sides.items() if r == "sparse"])


def _categorical_columns(first: pa.Schema, kinds: dict[str, str], dense: list[str] | None,
                         path: str) -> list[str]:
    """Columns that can be sparse features, in file order, less ``dense``; a DataError
    naming every column and its type if there is none."""
    names = [n for n, k in kinds.items() if k in (_INT, _INT_LIST, _CAT, _CAT_LIST)]
    names = [n for n in names if n not in (dense or [])]
    if not names:
        found = ", ".join(f"{f.name} ({type_name(f.type)})" for f in first)
        raise DataError(f"no categorical column (int, string, binary, dictionary or a list of "
                        f"those) to use as a sparse feature; columns found: {found}", file=path)
    return names


def _readable(files: list[str]) -> list[str]:
    """The files whose footers open; a DataError naming the first if none does."""
    from data.files import footer

    out, first_error = [], None
    for path in files:
        try:
            footer(path)
            out.append(path)
        except DataError as e:
            first_error = first_error or e
    if not out:
        raise DataError(f"none of the {len(files)} data file(s) is readable, the first: "
                        f"{first_error}")
    return out


def _families(path: str, columns: list[str], sparse: set[str]) -> list[str | None]:
    """value_family of each column in a file's footer (None where it is missing)."""
    from data.files import footer

    arrow = footer(path).schema_arrow
    return [value_family(arrow.field(c).type, c not in sparse)
            if arrow.get_field_index(c) >= 0 else None for c in columns]


def _max_ids(files: list[str], names: list[str]) -> dict[str, int]:
    """Largest id of each column over all files (-1 where a column holds none)."""
    return {n: hi for n, (_, hi) in id_ranges(files, names).items()}


def id_ranges(files: list[str], names: list[str]) -> dict[str, tuple[int, int]]:
    """(smallest, largest) id of each int column over all files, from the row-group
    statistics where they are: (min(0, smallest), largest), (0, -1) where a column holds
    none."""
    import pyarrow.compute as pc

    from data.files import LastOpened, footer

    best = dict.fromkeys(names, -1)
    low = dict.fromkeys(names, 0)
    opened = LastOpened()  # a file without statistics is opened once, not per row group
    for path in files:
        md = footer(path).metadata
        paths = [md.schema.column(j).path for j in range(md.num_columns)]
        leaf = {}
        for name in names:
            hits = [j for j, p in enumerate(paths) if p == name or p.startswith(name + ".")]
            if not hits:
                raise DataError("column is missing", file=path, column=name)
            leaf[name] = hits[0]
            for g in range(md.num_row_groups):
                stats = md.row_group(g).column(leaf[name]).statistics
                if stats is not None and stats.has_min_max:
                    best[name] = max(best[name], int(stats.max))
                    low[name] = min(low[name], int(stats.min))
                    continue
                col = opened(path).read_row_group(g, columns=[name]).column(name)
                if column_kind(col.type) == _INT_LIST:
                    col = pc.list_flatten(col)
                bounds = pc.min_max(col).as_py()
                if bounds["max"] is not None:
                    best[name] = max(best[name], int(bounds["max"]))
                    low[name] = min(low[name], int(bounds["min"]))
    return {n: (low[n], best[n]) for n in names}


@dataclass
class Screened:
    """The files a reader may use, their row groups' sizes, and the files left out."""

    files: list[str]
    row_groups: list[list[int]]  # rows of each row group of each usable file
    left_out: list[BadRecord]  # on_error="skip" only


def screen_files(files: list[str], schema: Schema, on_error: str = "fail") -> Screened:
    """Check every file's footer against ``schema``, in order.

    A file that is not Parquet (or is truncated), lacks a column, has a column of the
    wrong kind, or of a type that differs from the first usable file's, is a DataError
    naming the file and column (``on_error="fail"``), or is left out and recorded
    (``"skip"``). Either way a dataset of 0 usable rows is a DataError.
    """
    from data.files import footer

    if not files:
        raise DataError("no data files given")
    seen: dict[str, tuple[str, str, str]] = {}  # column → (family, type name, first usable file)
    out = Screened([], [], [])
    for path in files:
        rows = None
        try:
            pf = footer(path)
            rows = pf.metadata.num_rows
            types = _column_types(pf.schema_arrow, path, schema, seen, empty=not rows)
        except DataError as e:
            if on_error != "skip":
                raise
            out.left_out.append(BadRecord(path, e.reason, column=e.column,
                                          row=None if rows is None else 0, rows=rows))
            continue
        for col, found in types.items():
            seen.setdefault(col, (*found, path))
        md = pf.metadata
        out.files.append(path)
        out.row_groups.append([md.row_group(g).num_rows for g in range(md.num_row_groups)])
    if sum(map(sum, out.row_groups)) == 0:
        if out.left_out:
            first = out.left_out[0]
            raise DataError(f"no usable rows: {len(out.left_out)} of the {len(files)} data "
                            f"file(s) left out, the first {first.file} ({first.reason})")
        raise DataError(f"the {len(files)} data file(s) hold 0 rows, starting with {files[0]}")
    return out


def _column_types(arrow: pa.Schema, path: str, schema: Schema,
                  seen: dict[str, tuple[str, str, str]], empty: bool = False) -> dict[str, tuple[str, str]]:
    """(value family, type name) of each of the schema's columns in one file; a DataError
    if one is wrong, or of another family than in an earlier file. In a file of no rows
    (``empty``) a column typed null (pandas' empty object column) holds nothing to fit."""
    import pyarrow as pa

    types = {}
    for col in schema.columns:
        if arrow.get_field_index(col) < 0:
            raise DataError("column is missing (or appears twice)", file=path, column=col)
        t = arrow.field(col).type
        if empty and pa.types.is_null(t):
            continue
        allowed = allowed_kinds(schema, col)
        if column_kind(t) not in allowed:
            hint = ": a bool column trains as a dense 0/1 value (data.dense)" if column_kind(t) == _BOOL else ""
            raise DataError(
                f"type {type_name(t)} is not the expected {' or '.join(allowed)}{hint}",
                file=path, column=col,
            )
        name, family = type_name(t), value_family(t, col not in schema.sparse_names)
        before = seen.get(col, (family, name, path))
        if before[0] != family:
            raise DataError(
                f"type {name} differs from {before[1]} in {before[2]}", file=path, column=col
            )
        types[col] = (family, name)
    return types


def check_files(files: list[str], schema: Schema, on_error: str = "fail") -> list[int]:
    """Check every file's footer against ``schema`` (see ``screen_files``); return the
    row count of each usable file."""
    return [sum(groups) for groups in screen_files(files, schema, on_error).row_groups]
